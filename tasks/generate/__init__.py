"""Answers: generation (plain, FLARE, map-reduce, direct), the evidence-first answer
(``extract_answer``), the answerability gate (``answerable``) and fact checking (``verify``)."""
