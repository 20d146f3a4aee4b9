"""What the generator is given: passages expanded to their neighbours, refined (sentences, notes,
abstractive or extractive) and inserted into the prompt in order (``insert``)."""
