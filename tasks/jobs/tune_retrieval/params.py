"""What ``tune_retrieval`` tries and how it judges: its parameters and metrics."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field



Metric = Literal["ndcg@10", "mrr@10", "recall@100"]


METRICS = ("ndcg@10", "mrr@10", "recall@100")


QUERY_BATCH = 32  # query vectors per Chroma call


GATE_DOCUMENTS = 3  # references per LLM calibration question: its source and the closest other documents


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipelines: list[str] = Field(default_factory=list,
                                 description="query pipelines to tune; empty: every one that fuses a dense and a "
                                             "BM25 retriever over this step's index")
    metric: Metric = Field("ndcg@10", description="what the choice maximises on the pseudo-queries")
    methods: list[Literal["rrf", "score"]] = Field(["rrf", "score"], min_length=1, description="fusion methods")
    rrf_k: list[int] = Field([5, 10, 20, 40, 60, 100], min_length=1, description="RRF constants tried")
    dense_weights: list[float] = Field([0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0], min_length=1,
                                       description="dense share of the fusion weight (BM25 gets the rest); "
                                                   "0: BM25 alone, 1: dense alone")
    depths: list[int] = Field([50, 100], min_length=1, description="passages per retriever tried (k)")
    bm25_k1: list[float] = Field([0.9, 1.2, 1.5], min_length=1, description="BM25 k1 values tried")
    bm25_b: list[float] = Field([0.5, 0.75, 0.9], min_length=1, description="BM25 b values tried")
    bm25_stemmer: list[Literal["english", "none"]] = Field(["english", "none"], min_length=1,
                                                           description="stemmers tried")
    bm25_fused: int = Field(3, ge=1, le=50, description="best BM25 variants (alone) that enter fusion, plus the "
                                                         "current one")
    gate_keep: float | None = Field(0.98, gt=0.5, lt=1.0,
                                    description="answerability gates get the similarity floor that this share of "
                                                "pseudo-queries clears with their own source; null: leave gates "
                                                "as the file sets them")
    gate_llm_pairs: int = Field(0, ge=0, le=2000,
                                description="pseudo-queries put through the gates' LLM check (one 1-token call "
                                            "each) to set min_probability to what gate_keep of them clear; 0: "
                                            "leave min_probability as the file sets it (it needs a model that "
                                            "reads: the packaged ones do not)")
    gate_llm_min_refusal: float = Field(0.25, ge=0, le=1,
                                        description="set min_probability only if it refuses at least this share "
                                                    "of the pseudo-queries asked without their source")
    min_gain: float = Field(0.0, ge=0.0, le=1.0, description="keep pipelines.yaml's setting unless a candidate "
                                                              "beats it by more than this on the metric")
    confidence: float = Field(0.95, gt=0.5, lt=1.0,
                              description="leave the best single retriever only for a fused candidate whose "
                                          "paired-bootstrap interval of the gain over it, at this confidence and "
                                          "simultaneous over all the fused candidates, is above 0; an opt-in step "
                                          "(expansions, query2doc) is turned on only where an interval "
                                          "simultaneous over all its settings tried is")
    bootstrap: int = Field(1000, ge=100, le=100_000, description="bootstrap resamples of the pseudo-queries")
    seed: int = Field(0, description="bootstrap seed: the same pairs give the same choice")
    recall_margin: float = Field(0.01, ge=0.0, le=1.0,
                                 description="recall guard: a candidate that loses more Recall@100 than this to "
                                             "another one ...")
    recall_trade: float = Field(0.005, ge=0.0, le=1.0,
                                description="... is never chosen for a gain of this much of the metric or less")
    expansions: bool = Field(True, description="decide the expand_prf / expand_terms steps (mode corpus, dense: "
                                                "false) that feed a tuned pipeline's BM25 retriever: on, with the "
                                                "best settings below, only for a significant gain over off")
    prf_docs: list[int] = Field([5, 10], min_length=1, description="expand_prf: feedback passages tried")
    prf_terms: list[int] = Field([5, 10, 20], min_length=1, description="expand_prf: feedback terms tried")
    prf_query_weight: list[float] = Field([0.5, 0.7, 0.9], min_length=1,
                                          description="expand_prf: the request's own share tried")
    related_terms: list[int] = Field([5, 10, 20, 30], min_length=1, description="expand_terms: terms tried")
    related_weight: list[float] = Field([0.1, 0.2, 0.3, 0.5], min_length=1,
                                        description="expand_terms: the added terms' share tried")
    query2doc_pairs: int = Field(100, ge=0, le=2000,
                                 description="query2doc (rewrite mode hyde, keyword: true, on the BM25 side of a tuned "
                                             "pipeline): pseudo-queries whose pseudo-document the LLM writes, one "
                                             "call each, to decide it on or off; 0: leave such steps as the file "
                                             "has them")
    query2doc_repeats: list[Annotated[int, Field(ge=1, le=20)]] = Field([1, 3, 5], min_length=1,
                                                                        description="query2doc: query_repeats tried")
    query2doc_agreement: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        [0.4, 0.6, 0.8], min_length=1, description="query2doc with samples > 1 (self-consistency): min_agreement "
                                                   "tried, on the same samples (no further LLM call)")
    query2doc_samples: int = Field(0, ge=0, le=16, description="also try query2doc with self-consistency on a step "
                                                               "of one sample: this many samples (one more LLM call "
                                                               "per pseudo-query); 0 or 1: only the step's own")
    context: bool = Field(True, description="decide the expand_context steps of tuned pipelines: the smallest window "
                                             "whose top passages hold the pseudo-query's source chunk within "
                                             "context_margin of the best window")
    context_neighbours: list[Annotated[int, Field(ge=0, le=10_000)]] = Field(
        [0, 1, 2, 4], min_length=1, description="expand_context: neighbours tried (0: no expansion)")
    context_tokens: list[Annotated[int, Field(ge=16, le=32_768)]] = Field(
        [256, 512, 1024], min_length=1, description="expand_context: max_tokens tried")
    context_margin: float = Field(0.02, ge=0.0, le=1.0,
                                  description="expand_context: the smallest window (tokens shown) whose hold rate is "
                                              "within this of the best window's")
    context_pairs: int = Field(300, ge=1, le=5000, description="expand_context: pseudo-queries replayed (those "
                                                                 "cut from a chunk)")
    max_seconds: float | None = Field(600.0, gt=0, description="stop trying BM25 variants after this long")
    write: bool = Field(True, description="write the overlay (false: report only)")
    overlay: str | None = Field(None, description="overlay file; default: <pipelines file stem>.tuned.yaml beside "
                                                  "the data (the pipelines file's folder, or --data-dir)")
