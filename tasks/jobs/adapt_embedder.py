"""Domain adaptation of the embedder (opt-in): fine-tune it on pseudo-query pairs made from the index.

Each pair (``pseudo_queries``: a sentence or title cut out of a document, or an LLM question)
becomes one training row: the query, its passage (the chunk it came from, *without* the cut
text, so the model cannot learn to match a sentence with itself) and ``hard_negatives`` passages
that BM25 ranks highest for the query among the chunks of *other* documents (one per document;
hits scoring 0 do not count, a shortfall is filled with random chunks of other documents).
sentence-transformers' own ``SentenceTransformerTrainer`` trains the model with
``MultipleNegativesRankingLoss``: every other passage in the batch and the hard negatives are the
negatives; the no-duplicates batch sampler keeps a passage from being both a positive and a
negative in one batch.

The model is saved as a versioned local folder, ``<index folder>/models/<base>-adapted-<key>``
where the key hashes the base model, the training rows and the training parameters: the same
pairs on the same index with the same seed give the same folder, and a finished one is reused.
A manifest (``ragline-adapt.json``) beside the weights records the base model, the pairs, the
parameters and the training time. The stage then points the embedder at the model in the tuned
overlay (``flows.overlay.write_adaptation``: ``resources: {embedder: {model: <path>}}``, keeping
what ``ragline tune`` wrote there; ``write: false`` only reports the entry). Because the model is
part of the embedder's settings fingerprint, the next ingestion re-embeds every chunk; until it
has, dense retrieval refuses to compare the adapted model's queries with the old vectors
(``ChromaStore.check_embedder``). Similarities change with the model, so run ``ragline tune``
again after that ingestion (its gate floor is one). Adapting from an adapted model starts again
from its base model.

Only the index is read (its chunks and the BM25 settings), never queries or judgements; nothing
is downloaded (HF_HUB_OFFLINE) and nothing is reported anywhere (``report_to`` is empty).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ragline.flows.context import StepContext
from ragline.flows.contracts import AdaptReport, PseudoQuery
from ragline.flows.spec.registry import stage
from ragline.flows.resources.stores.bm25 import in_memory, tokenize
from ragline.flows.resources.models.embedder import Embedder, EmbedderSpec, resolve_model_path
from ragline.flows.resources.stores.state import IndexState
from ragline.flows.resources.stores.protocols import SparseIndex
from ragline.tasks.jobs.tune_retrieval import Corpus, closest_of_other_documents
from ragline.tasks.ingest.pseudo_queries import without

MANIFEST = "ragline-adapt.json"
VERSION = 1  # of the training recipe: part of the folder's key
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
           "DISABLE_MLFLOW_INTEGRATION": "TRUE"}


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: float = Field(1.0, gt=0, le=50, description="passes over the pairs")
    batch_size: int = Field(32, ge=2, le=1024, description="pairs per step: every other passage in the batch is "
                                                            "a negative too")
    learning_rate: float = Field(2e-5, gt=0, le=1e-2)
    warmup: float = Field(0.1, ge=0, lt=1, description="share of the steps with a linear learning-rate warmup")
    hard_negatives: int = Field(1, ge=0, le=16, description="BM25-mined negatives per pair (chunks of other "
                                                            "documents); 0: in-batch negatives only")
    skip_top: int = Field(0, ge=0, le=100, description="other documents' top BM25 hits passed over before negatives "
                                                        "are taken (they may be unlabelled positives)")
    max_seq_length: int | None = Field(None, ge=16, le=8192, description="tokens per text while training; "
                                                                          "None: the embedder's")
    seed: int = Field(0, description="the same seed on the same pairs trains the same model")
    max_seconds: float | None = Field(3600.0, gt=0, description="stop training after this long (the model is "
                                                                "saved as it is, marked stopped early)")
    output: str | None = Field(None, description="model folder; default <index folder>/models/<base>-adapted-<key>; "
                                                 "relative paths are relative to the data folder")
    overwrite: bool = Field(False, description="train again even when a finished model with this key exists")
    progress: bool = Field(True, description="show the trainer's progress bar (only on a terminal)")
    write: bool = Field(True, description="point the embedder at the model in the tuned overlay (false: report "
                                          "the entry only)")
    overlay: str | None = Field(None, description="overlay file; default: <pipelines file stem>.tuned.yaml beside "
                                                  "the data")


@stage("adapt_embedder", params=Params, produces="adaptation", kind="job",
       uses={"embedder": ("sentence_transformer",), "sparse": ("bm25", "milvus"), "state": ("index_state",)})
def adapt_embedder(pairs: list[PseudoQuery], params: Params, ctx: StepContext, embedder: Embedder,
                   sparse: SparseIndex, state: IndexState) -> AdaptReport:
    """Fine-tune the embedder on pseudo-query pairs with BM25 hard negatives; save it as a local model."""
    started = time.perf_counter()
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
    _offline_hub()
    resource, spec = _embedder_spec(ctx, embedder)
    base = base_model(spec.model)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    corpus = Corpus.from_state(state)
    pairs = [p for p in pairs if p.source_id in corpus.doc_index]
    if not pairs:
        raise ValueError("no pseudo-queries to train on (is the index empty?)")
    timings["corpus"] = time.perf_counter() - clock
    clock = time.perf_counter()
    rows = training_rows(pairs, corpus, sparse.spec, params.hard_negatives, params.skip_top, params.seed)
    timings["mining"] = time.perf_counter() - clock
    if not rows.anchors:
        raise ValueError("no pair has a passage left to train on")
    max_len = params.max_seq_length or spec.max_seq_length
    key = model_key(base, spec, rows, params)
    folder = output_folder(ctx, state, params, base, key)
    report = AdaptReport(model_path=str(folder), base_model=base, embedder=resource, key=key,
                         pairs=len(rows.anchors), hard_negatives=params.hard_negatives,
                         mined_negatives=rows.mined, chunks=len(corpus.ids),
                         strategies={s: sum(p.strategy == s for p in rows.pairs)
                                     for s in sorted({p.strategy for p in rows.pairs})})
    manifest = read_manifest(folder)
    if manifest is not None and manifest.get("key") == key and not manifest.get("stopped_early") \
            and not params.overwrite:
        ctx.logger.info("adapt: %s exists (key %s): reused", folder, key)
        report.reused = True
        report.steps, report.epochs, report.loss = manifest["steps"], manifest["epochs"], manifest.get("loss")
        report.created = manifest["created"]
        timings["training"] = 0.0
    else:
        clock = time.perf_counter()
        trained = train(rows, base, spec, params, max_len, folder, ctx)
        timings["training"] = time.perf_counter() - clock
        report.steps, report.epochs, report.loss = trained.steps, trained.epochs, trained.loss
        report.stopped_early = trained.stopped_early
        report.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        clock = time.perf_counter()
        save(trained.model, folder, {
            "key": key, "version": VERSION, "base_model": base, "pairs": len(rows.anchors),
            "strategies": report.strategies, "mined_negatives": rows.mined, "chunks": len(corpus.ids),
            "params": training_params(params, max_len), "steps": trained.steps, "epochs": trained.epochs,
            "loss": trained.loss, "stopped_early": trained.stopped_early,
            "train_seconds": round(timings["training"], 2), "created": report.created})
        timings["saving"] = time.perf_counter() - clock
    report.overlay = {"resources": {resource: {"model": str(folder)}}}
    report.overlay_yaml = overlay_yaml(report.overlay)
    report.timings = {k: round(v, 2) for k, v in timings.items()}
    report.write_requested = params.write and ctx.project is not None  # the job runner writes it
    report.overlay_file = params.overlay
    report.seconds = round(time.perf_counter() - started, 2)
    ctx.progress("pairs", report.pairs)
    ctx.logger.info("adapt: %s from %s on %d pairs in %.1f s%s", folder, base, report.pairs, report.seconds,
                    " (reused)" if report.reused else "")
    return report


# ----------------------------------------------------------------------------- training rows
@dataclass
class Rows:
    """One training row per usable pair: query, passage, hard negatives (texts), and for checks
    the chunk indexes of the passage and of each negative."""

    pairs: list[PseudoQuery] = field(default_factory=list)
    anchors: list[str] = field(default_factory=list)
    positives: list[str] = field(default_factory=list)
    negatives: list[list[str]] = field(default_factory=list)
    positive_chunks: list[int] = field(default_factory=list)
    negative_chunks: list[list[int]] = field(default_factory=list)
    mined: int = 0  # negatives found by BM25 (the rest: random chunks of other documents)


def training_rows(pairs: list[PseudoQuery], corpus: Corpus, bm25: Any, negatives: int, skip: int = 0,
                  seed: int = 0) -> Rows:
    """The training rows: each pair's passage without the cut text, and ``negatives`` chunks of other
    documents that BM25 (the index's own settings) ranks highest for the query, one per document,
    after passing over ``skip`` of them."""
    position = {cid: i for i, cid in enumerate(corpus.ids)}
    rows = Rows()
    usable: list[tuple[PseudoQuery, int, str]] = []
    for pair in pairs:
        chunk = position.get(pair.chunk_id)
        if chunk is None:  # re-chunked since: the document's first chunk
            chunk = corpus.chunks_of[corpus.doc_index[pair.source_id]][0]
        passage = _passage(pair, chunk, corpus)
        if passage is not None:
            usable.append((pair, *passage))
    mined = _mine(usable, corpus, bm25, negatives + skip) if negatives else [[] for _ in usable]
    for (pair, chunk, text), hits in zip(usable, mined):
        source = corpus.doc_index[pair.source_id]
        picked = hits[skip:skip + negatives]
        rows.mined += len(picked)
        if len(picked) < negatives:  # too few BM25 hits: random chunks of other documents
            rng = random.Random(f"{seed}:{pair.source_id}:{pair.chunk_id}")
            taken = {int(corpus.docs[c]) for c in hits}  # the passed-over hits may be unlabelled positives
            for c in rng.sample(range(len(corpus.ids)), len(corpus.ids)):
                if len(picked) >= negatives:
                    break
                doc = int(corpus.docs[c])
                if doc != source and doc not in taken and corpus.texts[c] != text:
                    picked.append(c)
                    taken.add(doc)
        rows.pairs.append(pair)
        rows.anchors.append(pair.text)
        rows.positives.append(text)
        rows.positive_chunks.append(chunk)
        rows.negative_chunks.append(picked)
        rows.negatives.append([corpus.texts[c] for c in picked])
    if negatives:  # every row needs the same columns: drop rows the corpus could not fill
        keep = [i for i, n in enumerate(rows.negative_chunks) if len(n) == negatives]
        for name in ("pairs", "anchors", "positives", "negatives", "positive_chunks", "negative_chunks"):
            setattr(rows, name, [getattr(rows, name)[i] for i in keep])
    return rows


def _passage(pair: PseudoQuery, chunk: int, corpus: Corpus) -> tuple[int, str] | None:
    """The pair's chunk without the cut text; when nothing of it is left, the document's longest chunk."""

    text = without(corpus.texts[chunk], pair.cut).strip()
    if len(text.split()) >= 3:
        return chunk, text
    candidates = [(len(t), c, t) for c in corpus.chunks_of[corpus.doc_index[pair.source_id]]
                  if len((t := without(corpus.texts[c], pair.cut).strip()).split()) >= 3]
    if not candidates:
        return None
    _, c, t = max(candidates)
    return c, t


def _mine(usable: list[tuple[PseudoQuery, int, str]], corpus: Corpus, bm25: Any, wanted: int) -> list[list[int]]:
    """Per pair, up to ``wanted`` chunk indexes of other documents in BM25 order (best chunk per
    document, score > 0)."""
    retriever = in_memory(tokenize(corpus.texts, bm25.stemmer, bm25.stopwords), bm25)
    queries = tokenize([p.text for p, _, _ in usable], bm25.stemmer, bm25.stopwords)
    longest = max(len(c) for c in corpus.chunks_of.values())
    k = min(len(corpus.ids), wanted * longest + longest + 20)
    asked = [i for i, q in enumerate(queries) if q]
    found: list[list[int]] = [[] for _ in usable]
    if not asked:
        return found
    docs, scores = retriever.retrieve([queries[i] for i in asked], k=k, show_progress=False, n_threads=1)
    for row, i in enumerate(asked):
        pair, _, text = usable[i]
        # equal scores in chunk order: bm25s orders ties by its partial sort, which depends on k
        ranking = sorted(zip(docs[row].tolist(), scores[row].tolist()), key=lambda hit: (-hit[1], hit[0]))
        found[i] = closest_of_other_documents([(c, s) for c, s in ranking if s > 0 and corpus.texts[c] != text],
                                              corpus.docs, corpus.doc_index[pair.source_id], wanted)
    return found


# ----------------------------------------------------------------------------- the model and its folder
def base_model(model: str) -> str:
    """The model to train from: an adapted model's own base (read from its manifest), else ``model``."""
    manifest = read_manifest(Path(model)) if Path(model).is_dir() else None
    return str(manifest["base_model"]) if manifest and manifest.get("base_model") else model


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def training_params(params: Params, max_seq_length: int | None) -> dict[str, Any]:
    """The parameters that shape the model (not the time budget, folder or progress bar)."""
    chosen = params.model_dump(include={"epochs", "batch_size", "learning_rate", "warmup", "hard_negatives",
                                        "skip_top", "seed"})
    return {**chosen, "max_seq_length": max_seq_length}


def model_key(base: str, spec: EmbedderSpec, rows: Rows, params: Params) -> str:
    """Short hash of the base model, the prefixes, the training rows and the training parameters."""
    payload = {"version": VERSION, "base": base, "query_prefix": spec.query_prefix,
               "document_prefix": spec.document_prefix,
               "params": training_params(params, params.max_seq_length or spec.max_seq_length),
               "rows": [[a, p, n] for a, p, n in zip(rows.anchors, rows.positives, rows.negatives)]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def output_folder(ctx: StepContext, state: IndexState, params: Params, base: str, key: str) -> Path:
    """``params.output`` (relative to the data folder), or ``<index folder>/models/<base>-adapted-<key>``."""
    if params.output:
        path = Path(params.output)
        if not path.is_absolute():
            project = ctx.project
            data = (project.data_dir or project.base_dir) if project is not None else Path(ctx.base_dir)
            path = Path(data) / path
        return path.resolve()
    name = Path(base.rstrip("/")).name or "model"
    return (state.path.parent / "models" / f"{name}-adapted-{key}").resolve()


def overlay_yaml(overlay: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(overlay, sort_keys=False, default_flow_style=False)


def _embedder_spec(ctx: StepContext, embedder: Embedder) -> tuple[str, EmbedderSpec]:
    """The embedder's resource name and its settings as pipelines.yaml writes them (before any overlay)."""
    project = ctx.project
    if project is None:
        return "embedder", embedder.spec
    try:
        name = project.pipeline(ctx.pipeline).step(ctx.step_id).resources.get("embedder", "embedder")
    except KeyError:
        return "embedder", embedder.spec
    plain = project.untuned or project
    spec = plain.spec.resources.get(name)
    return name, spec if isinstance(spec, EmbedderSpec) else embedder.spec


def _offline_hub() -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: apply it if the import came first."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


# ----------------------------------------------------------------------------- training
@dataclass
class Trained:
    model: Any
    steps: int
    epochs: float
    loss: float | None
    stopped_early: bool


def train(rows: Rows, base: str, spec: EmbedderSpec, params: Params, max_seq_length: int | None,
          folder: Path, ctx: StepContext) -> Trained:
    """sentence-transformers' trainer with MultipleNegativesRankingLoss (in-batch and hard negatives)."""
    try:
        import datasets  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("adapt_embedder trains with sentence-transformers' trainer, which needs `datasets` and "
                           "`accelerate`: pip install 'sentence-transformers[train]'") from exc
    import transformers
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    transformers.set_seed(params.seed)
    model = SentenceTransformer(resolve_model_path(base), device=spec.device)  # a copy of its own: never the shared one
    served_length = model.max_seq_length
    if max_seq_length:
        model.max_seq_length = max_seq_length
    columns: dict[str, list[str]] = {"anchor": [spec.query_prefix + a for a in rows.anchors],
                                     "positive": [spec.document_prefix + p for p in rows.positives]}
    for j in range(params.hard_negatives):
        columns[f"negative_{j + 1}"] = [spec.document_prefix + n[j] for n in rows.negatives]
    dataset = Dataset.from_dict(columns)
    scratch = folder.parent / f".{folder.name}.train-{os.getpid()}"
    show = params.progress and sys.stderr.isatty()
    args = SentenceTransformerTrainingArguments(
        output_dir=str(scratch), num_train_epochs=params.epochs, per_device_train_batch_size=params.batch_size,
        learning_rate=params.learning_rate, warmup_steps=params.warmup, seed=params.seed, data_seed=params.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", eval_strategy="no", logging_strategy="no",
        report_to=[], disable_tqdm=not show, dataloader_num_workers=0,
        use_cpu=not str(spec.device).startswith(("cuda", "mps", "xpu")))
    budget = _budget(params.max_seconds, ctx)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset,
                                         loss=MultipleNegativesRankingLoss(model), callbacks=[budget])
    trainer.remove_callback(transformers.PrinterCallback)  # it prints metrics to stdout (`ragline run` prints JSON)
    try:
        output = trainer.train()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    model.max_seq_length = served_length  # the training length is no setting of the saved model
    state = trainer.state
    if budget.stopped:
        ctx.logger.warning("adapt: time budget of %s s spent after %d of %d steps", params.max_seconds,
                           state.global_step, state.max_steps)
    loss = getattr(output, "training_loss", None)
    return Trained(model=model, steps=int(state.global_step), epochs=round(float(state.epoch or 0.0), 3),
                   loss=round(float(loss), 5) if loss is not None else None,
                   stopped_early=budget.stopped and state.global_step < state.max_steps)


def _budget(seconds: float | None, ctx: StepContext):
    """A trainer callback that reports each step to the run's progress and stops after ``seconds``."""
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        stopped = False
        deadline: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.deadline = None if seconds is None else time.monotonic() + seconds

        def on_step_end(self, args, state, control, **kwargs):
            ctx.progress("steps", 1)
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.stopped = True
                control.should_training_stop = True
                control.should_epoch_stop = True
            return control

    return Budget()


def save(model: Any, folder: Path, manifest: dict[str, Any]) -> None:
    """Write the model and its manifest to a fresh folder, then move it into place (a crash leaves
    either the old folder or the new one, never half of one)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.parent / f".{folder.name}.new-{os.getpid()}"
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        model.save(str(fresh), create_model_card=False)
        (fresh / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            os.replace(folder, old)
            os.replace(fresh, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(fresh, folder)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
