"""Stages that record their calls (``CALLED``) and pipelines that route between them with `when`, for the
conditional-step tests in process (flows/run/test_conditions.py) and as Prefect task runs
(integration/test_routing_prefect.py). Importing this module registers the stages."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ragline.flows.contracts import Answer, Context, ContextDocument, Label, Passage, Query, Ranking
from ragline.flows.spec.registry import NoParams, stage


CALLED: list[str] = []


class RouteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: list[str] = ["retrieve", "chitchat"]


@stage("test_route_word", params=RouteParams, produces="query", kind="query", labels=lambda p: p.labels)
def _route(query: Query, params: RouteParams, ctx) -> Query:
    """'hi ...' is chit-chat; anything else is retrieved for; 'nolabel' gives no label at all."""
    CALLED.append(ctx.step_id)
    if query.text == "nolabel":
        return query
    label = "chitchat" if query.text.lower().startswith("hi") else "retrieve"
    return query.model_copy(update={"labels": {**query.labels, ctx.step_id: Label(label=label, mode="test")}})


@stage("test_mark_rewrite", params=NoParams, produces="query", kind="query")
def _rewrite(query: Query, ctx) -> Query:
    CALLED.append(ctx.step_id)
    return query.model_copy(update={"variants": [query.text + " (rewritten)"]})


@stage("test_cond_retriever", params=NoParams, produces="rankings", kind="query")
def _retrieve(query: Query, ctx) -> list[Ranking]:
    CALLED.append(ctx.step_id)
    return [Ranking(retriever=ctx.step_id, query=t, passages=[Passage(chunk_id=f"{ctx.step_id}|{t}", source_id="s",
                                                                      text=t)]) for t in query.search_texts()]


@stage("test_cond_context", params=NoParams, produces="context", kind="query")
def _context(passages: list[Passage], ctx) -> Context:
    CALLED.append(ctx.step_id)
    return Context(documents=[ContextDocument(number=i, passage=p) for i, p in enumerate(passages, start=1)])


@stage("test_cond_answer", params=NoParams, produces="answer", kind="query")
def _answer(query: Query, context: Context, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return Answer(question=query.text, text=f"from {len(context.documents)} documents")


@stage("test_cond_reply", params=NoParams, produces="answer", kind="query")
def _reply(query: Query, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return Answer(question=query.text, text="hello to you" + (" (after a rewrite)" if query.variants else ""))


@stage("test_cond_check", params=NoParams, produces="answer", kind="query")
def _check(answer: Answer, context: Context, ctx) -> Answer:
    CALLED.append(ctx.step_id)
    return answer.model_copy(update={"verdict": "supported"})


ATTEMPTS: dict[str, int] = {}


@stage("test_cond_flaky_reply", params=NoParams, produces="answer", kind="query")
def _flaky_reply(query: Query, ctx) -> Answer:
    """Fails on its first attempt (a dropped LLM connection), answers on the second."""
    ATTEMPTS[ctx.step_id] = ATTEMPTS.get(ctx.step_id, 0) + 1
    if ATTEMPTS[ctx.step_id] == 1:
        raise ConnectionError("dropped")
    return Answer(question=query.text, text="hello on a retry")


ROUTED = """
pipelines:
  routed:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: rewrite, task: test_mark_rewrite, when: {step: route, label: retrieve}}
      - {id: dense,   task: test_cond_retriever, when: {step: route, label: retrieve}}
      - {id: fuse,    task: fuse}
      - {id: context, task: test_cond_context, when: {step: route, label: retrieve}}
      - {id: answer,  task: test_cond_answer, when: {step: route, label: retrieve}}
      - {id: reply,   task: test_cond_reply, after: [rewrite], when: {step: route, label: chitchat}}
      - {id: check,   task: test_cond_check, after: [answer, reply]}
  flaky:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: reply,   task: test_cond_flaky_reply, retries: 1, retry_delay_seconds: 0,
         when: {step: route, label: chitchat}}
  nested:
    kind: query
    steps:
      - {id: first,   task: test_route_word}
      - {id: route,   task: test_route_word, when: {step: first, label: retrieve}}
      - {id: reply,   task: test_cond_reply, when: {step: route, label: chitchat}}
  dead_end:
    kind: query
    steps:
      - {id: route,   task: test_route_word}
      - {id: answer,  task: test_cond_reply, when: {step: route, label: chitchat}}
"""


RETRIEVAL_BRANCH = {"rewrite", "dense", "context", "answer"}
