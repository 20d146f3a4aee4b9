"""Documents of three topics and a scripted LLM that summarises them by naming their topics, shared by
the community summary tests (tasks/jobs/test_summarize_communities.py, tasks/retrieve/test_summaries_collections.py)."""
from __future__ import annotations

import re

from tests.scripted_llm import ScriptedLLM

TOPICS = {
    "astronomy": ["The telescope observed a distant galaxy and its spiral arms of stars.",
                  "Astronomers measured the orbit of the planet around its star using the telescope.",
                  "A supernova explosion in the galaxy was seen by the space telescope last night.",
                  "The moon and the planets of the solar system orbit under gravity; astronomers chart them."],
    "cooking": ["Knead the bread dough with flour, yeast and water, then bake it in the oven.",
                "The recipe for tomato soup: simmer tomatoes, onion and garlic, season with salt.",
                "Whisk eggs and sugar for the cake batter, then bake the cake in a hot oven.",
                "Fry the onions in butter, add the rice and stock for a creamy risotto recipe."],
    "football": ["The striker scored a goal in the final minute and the team won the match.",
                 "The football club signed a new goalkeeper before the league season started.",
                 "The referee showed a red card and the match ended in a draw with no goals.",
                 "Fans cheered as the team lifted the league trophy after the football final."],
}


def is_summarise(prompt: str) -> bool:
    return prompt.rstrip().endswith("Summary:")


def summary_reply(prompt: str) -> str:
    """A summary naming the topics of the fenced documents it read (deterministic, so tests can check it)."""
    found = [t for t, texts in TOPICS.items() if any(w in prompt for w in (texts[0][:20], texts[1][:20],
                                                                         texts[2][:20], texts[3][:20]))]
    if "summarises part of a collection" in prompt:  # a merge: the topics named by the parts
        found = sorted(set(re.findall(r"topic (astronomy|cooking|football)", prompt)))
    return "These documents are about " + ", ".join(f"topic {t}" for t in sorted(found)) + "."


class Counting(ScriptedLLM):
    def summaries(self) -> list[str]:
        return [r["messages"][-1]["content"] for r in self.requests
                if "messages" in r and is_summarise(r["messages"][-1]["content"])]
