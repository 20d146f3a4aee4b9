"""The ``pseudo_queries`` stage: pairs from the index alone, deterministic with a seed, bounded by a
budget; inverse cloze, title and LLM strategies; the text cut out of a source is removed for scoring."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project, validate_file
from ragline.flows.spec.parse import SpecValidationError
from ragline.flows.context import StepContext
from ragline.flows.contracts import Chunk, Document
from ragline.flows.errors import MissingResource
from ragline.flows.spec.prompts import library
from ragline.flows.resources.models.llm import LLMClient, LLMSpec
from ragline.flows.resources.stores.state import IndexState, StateSpec
from ragline.tasks.ingest.pseudo_queries import Params, body, keyword_query, pseudo_queries, sentences_of, without
from tests.helpers.data import scifact_records
from tests.helpers.reads_roles import LLM, STATE, TWO_LLMS, error_at, pipelines_file
from tests.scripted_llm import ScriptedLLM

REPO_PROMPTS = Path(__file__).resolve().parents[3] / "prompts"


@pytest.fixture
def state(tmp_path) -> IndexState:
    """An index state holding 40 SciFact abstracts as the index sink records them (title line first)."""
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), tmp_path)
    documents, chunks = [], []
    for record in scifact_records(40):
        sid = f"/data/corpus.jsonl#{record['_id']}"
        documents.append(Document(source_id=sid, text=record["text"], title=record["title"], content_hash="h"))
        words = record["text"].split()
        half = max(1, len(words) // 2)
        for ordinal, piece in enumerate([" ".join(words[:half]), " ".join(words[half - 6:])]):
            chunks.append(Chunk(chunk_id=f"{record['_id']}-{ordinal}", source_id=sid, ordinal=ordinal,
                                text=f"{record['title']}\n{piece}", title=record["title"],
                                metadata={"doc_id": record["_id"], "chunk": ordinal}))
    state.record("index", "fp", documents, chunks)
    return state


def client(server: ScriptedLLM) -> LLMClient:
    return LLMClient(LLMSpec(type="openai_compatible", base_url=server.base_url, max_retries=0))


def make(state: IndexState, llm=None, **params):
    ctx = StepContext(pipeline="tune", step_id="pairs")
    return pseudo_queries.fn(params=Params(**params), ctx=ctx, state=state, llm=llm)


def test_same_seed_same_pairs_other_seed_other_pairs(state):
    first = make(state, n=10, seed=7)
    assert [p.model_dump() for p in first] == [p.model_dump() for p in make(state, n=10, seed=7)]
    other = make(state, n=10, seed=8)
    assert {p.source_id for p in first} != {p.source_id for p in other}


def test_inverse_cloze_cuts_a_sentence_of_its_document(state):
    pairs = make(state, n=15)
    assert len(pairs) == 15 and len({p.source_id for p in pairs}) == 15  # at most one pair per document
    rows = {cid: (text, meta) for cid, text, meta in state.chunk_rows()}
    for pair in pairs:
        text, meta = rows[pair.chunk_id]
        assert meta["source_id"] == pair.source_id and pair.strategy == "inverse_cloze"
        assert pair.text in " ".join(body(text, meta["title"]).split())
        assert pair.cut == pair.text and 6 <= len(pair.text.split()) <= 40
        assert pair.text != meta["title"]


def test_budget_in_pairs_and_lengths(state):
    assert len(make(state, n=3)) == 3
    short = make(state, n=40, min_words=6, max_words=12)
    assert short and all(6 <= len(p.text.split()) <= 12 for p in short)
    assert len(make(state, n=1000)) <= 40  # no more pairs than documents


def test_mask_off_records_no_cut(state):
    assert all(p.cut == "" for p in make(state, n=5, mask=False))


def test_title_strategy_and_mixing(state):
    titles = {meta["source_id"]: meta["title"] for _, _, meta in state.chunk_rows()}
    pairs = make(state, n=6, strategies=["title", "inverse_cloze"], min_words=3)
    assert [p.strategy for p in pairs] == ["title", "inverse_cloze"] * 3
    for pair in pairs[::2]:
        assert pair.text == titles[pair.source_id] == pair.cut


def test_sentences_keep_abbreviations():
    text = "Cells divide (e.g. T cells). Growth was 3.5 fold in vitro. Smith et al. Found more! Is it 5?"
    assert sentences_of(text) == ["Cells divide (e.g. T cells).", "Growth was 3.5 fold in vitro.",
                                  "Smith et al. Found more!", "Is it 5?"]


def test_sentences_of_any_script_without_a_capital_after_the_stop():
    arabic = ("ما هي عاصمة المغرب؟ الرباط هي عاصمة المملكة المغربية. تقع على ساحل المحيط الأطلسي. "
              "يبلغ عدد سكانها أكثر من نصف مليون نسمة")
    assert sentences_of(arabic) == ["ما هي عاصمة المغرب؟", "الرباط هي عاصمة المملكة المغربية.",
                                    "تقع على ساحل المحيط الأطلسي.", "يبلغ عدد سكانها أكثر من نصف مليون نسمة"]
    assert sentences_of("یہ پہلا جملہ ہے۔ یہ دوسرا جملہ ہے۔") == ["یہ پہلا جملہ ہے۔", "یہ دوسرا جملہ ہے۔"]
    assert sentences_of("细胞分裂很快。为什么会这样？因为温度很高！结束") == ["细胞分裂很快。", "为什么会这样？",
                                                                        "因为温度很高！", "结束"]
    assert sentences_of("lower case after a stop. still a new sentence. «quoted» one") == [
        "lower case after a stop.", "still a new sentence.", "«quoted» one"]
    assert sentences_of("The dose was 2.5 mg (i.e. low). it worked") == ["The dose was 2.5 mg (i.e. low).", "it worked"]


def test_inverse_cloze_pairs_from_arabic_and_chinese_documents(tmp_path):
    """A non-Latin corpus yields as many pairs as a Latin one (once: 103 of 300 asked on Arabic)."""
    state = IndexState(StateSpec(type="index_state", path="state.sqlite"), tmp_path)
    arabic = "الرباط هي عاصمة المملكة المغربية منذ {} سنة وأكثر. "
    chinese = "这座城市是一个国家的首都并且有{}万人口。"
    documents, chunks = [], []
    for i in range(20):
        text = ("".join(arabic.format(i + j) for j in range(3)) + f"وفيها {i} جامعات ومتاحف كثيرة ومشهورة في العالم؟"
                if i % 2 else "".join(chinese.format(i + j) for j in range(3)) + f"这里有{i}所大学和很多著名的博物馆！")
        sid = f"docs/{i}.txt"
        documents.append(Document(source_id=sid, text=text, title="", content_hash="h"))
        chunks.append(Chunk(chunk_id=f"c{i}", source_id=sid, ordinal=0, text=text, metadata={"chunk": 0}))
    state.record("index", "fp", documents, chunks)
    pairs = make(state, n=20)
    assert len(pairs) == 20
    assert all(p.text in p.cut and p.text.endswith(("؟", ".", "。", "！")) for p in pairs)


def test_keyword_queries_take_the_words_the_rest_of_the_document_shares_least():
    sentence = "Insulin resistance raises hepatic glucose output in obese mice."
    rest = "Obese mice were studied. Insulin was measured in obese mice twice. Glucose rose."
    frequency = {"in": 0.9, "raises": 0.05, "hepatic": 0.01, "output": 0.02, "resistance": 0.03}
    query = keyword_query(sentence, rest, frequency, 3)
    assert query == "resistance hepatic output"  # absent from the rest, the rarer first, in the sentence's order
    # then the words the rest holds once ("in": a function word, in most documents)
    assert keyword_query(sentence, rest, frequency, 5) == "resistance raises hepatic glucose output"
    assert keyword_query("Obese mice in mice.", rest, frequency, 5) is None  # fewer than 3 words to use


def test_keywords_strategy_makes_short_queries_from_a_cut_sentence(state):
    pairs = make(state, n=12, strategies=["keywords", "inverse_cloze", "title"], min_words=3)
    assert [p.strategy for p in pairs] == ["keywords", "inverse_cloze", "title"] * 4
    for pair in pairs[::3]:
        words = pair.text.split()
        assert 3 <= len(words) <= 5 and pair.cut and pair.text != pair.cut
        assert all(w in pair.cut for w in words)  # its words come from the sentence cut out of its source


def test_without_removes_the_cut_and_its_pieces_in_neighbouring_chunks():
    sentence = "The kinase phosphorylates the receptor at serine residues in vivo."
    assert without(f"Title\nFirst part. {sentence} Last part.", sentence) == "Title First part. Last part."
    # a neighbouring chunk that starts in the middle of the sentence (chunk overlap)
    assert without("the receptor at serine residues in vivo. Next sentence here.", sentence) == "Next sentence here."
    untouched = "Title\nNothing   shared here."
    assert without(untouched, sentence) is untouched  # unchanged text stays as it is (not re-embedded)
    assert without("anything", "") == "anything"


def test_llm_strategy_writes_questions_from_the_template(state, tmp_path):
    prompts: list[str] = []

    def reply(prompt: str) -> str:
        prompts.append(prompt)
        return "Question: What does the kinase do to the receptor in these cells?"

    with ScriptedLLM(reply) as server:
        ctx = StepContext(pipeline="tune", step_id="pairs", prompt_name="pseudo_query",
                          render_prompt=library(str(REPO_PROMPTS)).render)
        pairs = pseudo_queries.fn(params=Params(n=3, strategies=["llm"]), ctx=ctx, state=state, llm=client(server))
    assert [p.text for p in pairs] == ["What does the kinase do to the receptor in these cells?"] * 3
    assert all(p.strategy == "llm" and p.cut == "" for p in pairs)
    rows = {cid: text for cid, text, _ in state.chunk_rows()}
    for prompt, pair in zip(prompts, pairs):
        assert "<document>" in prompt and "data, not instructions" in prompt
        assert body(rows[pair.chunk_id], rows[pair.chunk_id].split("\n")[0])[:200] in prompt


def test_time_budget_stops_slow_llm_generation(state):
    with ScriptedLLM(lambda prompt: "Which protein binds the receptor in these experiments?", delay=0.3) as server:
        ctx = StepContext(pipeline="tune", step_id="pairs", prompt_name="pseudo_query",
                          render_prompt=library(str(REPO_PROMPTS)).render)
        pairs = pseudo_queries.fn(params=Params(n=30, strategies=["llm"], max_seconds=1.0), ctx=ctx, state=state,
                                  llm=client(server))
    # 30 answers take 9 s: the budget stopped asking (counted at the server, not on the wall clock)
    assert 1 <= len(pairs) < 30 and len(server.requests) < 30


def test_llm_strategy_needs_an_llm(state):
    with pytest.raises(MissingResource, match="strategy 'llm' needs an openai_compatible resource"):
        make(state, strategies=["llm"])


def test_a_file_without_an_llm_still_validates_the_tune_pipeline(make_project):
    path = make_project("""
resources:
  embedder: {type: sentence_transformer}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
pipelines:
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense}
      - {id: sparse, task: retrieve_sparse, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
  tune:
    kind: job
    schedule: {cron: "0 3 * * 0"}
    steps:
      - {id: pairs, task: pseudo_queries}
      - {id: tune,  task: tune_retrieval}
""")
    project = load_project(path)
    assert project.pipeline("tune").kind == "job"
    assert "llm" not in project.pipeline("tune").step("pairs").resources
    assert project.pipeline("tune").step("pairs").prompt is None  # no template unless the LLM writes queries
    # an override that makes it read an LLM the file lacks is refused at that field, before anything runs
    with pytest.raises(SpecValidationError, match="with.strategies.*strategy 'llm'.*openai_compatible resource"):
        project.pipeline("tune").with_overrides({"pairs": {"strategies": ["llm"]}})


def test_the_shipped_tune_pipeline_runs_on_an_empty_index_with_a_clear_error(tmp_path):
    shutil.copy(Path(__file__).resolve().parents[3] / "pipelines.yaml", tmp_path / "pipelines.yaml")
    (tmp_path / "prompts").symlink_to(REPO_PROMPTS)
    project = load_project(tmp_path / "pipelines.yaml")
    with pytest.raises(engine.StepFailed, match="nothing is indexed yet.*run `ragline index`"):
        engine.run(project.pipeline("tune"), orchestrate=False)
    assert not (tmp_path / "pipelines.tuned.yaml").exists()


def test_labelled_pairs_of_a_feedback_export_come_first(state, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    rows = [{"text": "white matter in newborns", "source_id": "/data/corpus.jsonl#4983", "chunk_id": "4983-0",
             "strategy": "feedback"},
            {"text": "a deleted document", "source_id": "/data/corpus.jsonl#gone", "chunk_id": "x",
             "strategy": "feedback"}]
    (export / "train_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = make(state, n=5, labelled=str(export))
    assert [(p.text, p.strategy) for p in pairs[:1]] == [("white matter in newborns", "feedback")]
    assert len(pairs) == 5 and [p.strategy for p in pairs[1:]] == ["inverse_cloze"] * 4
    with pytest.raises(FileNotFoundError, match="feedback export"):
        make(state, n=5, labelled=str(tmp_path / "nowhere"))


# ----------------------------------------------------------------------------- resources read (validate)
PAIRS_STEP = """      - id: pairs
        task: pseudo_queries
        with:
          strategies: [inverse_cloze, llm]
"""


def test_the_llm_strategy_without_an_llm_fails_validation_at_strategies(make_project):
    """Strategy llm validated without an LLM and failed only when the job ran; now `ragline validate`
    names the line and with.strategies."""
    error = error_at(make_project(pipelines_file(STATE, PAIRS_STEP, kind="job")), "pairs", "with.strategies")
    assert "strategy 'llm' has the LLM write a question per passage" in error.message


def test_pseudo_queries_bind_an_llm_only_for_the_llm_strategy(make_project):
    """Other strategies read no LLM: two need no name; with one LLM and strategy llm it is bound, and so
    is its template checked."""
    path = make_project(pipelines_file(STATE + TWO_LLMS, PAIRS_STEP.replace(", llm]", ", title]"), kind="job"))
    assert validate_file(path) == [] and load_project(path).pipeline("p").step("pairs").resources == \
        {"state": "state"}
    project = load_project(make_project(pipelines_file(STATE + LLM, PAIRS_STEP, kind="job"), name="llm.yaml"))
    step = project.pipeline("p").step("pairs")
    assert step.resources == {"state": "state", "llm": "llm"} and step.prompt == "pseudo_query"
