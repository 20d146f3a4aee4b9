"""Unit tests for the sentence-transformers embedder (flows.resources.embedder) with the packaged MiniLM."""
from __future__ import annotations

import json
import platform
import threading

from pathlib import Path

import numpy as np
import psutil
import pytest

from ragline.flows.resources.models.embedder import PACKAGED_MODELS, Embedder, EmbedderSpec, resolve_model_path
from tests.helpers.memory import in_a_fresh_process


def test_packaged_model_resolves_offline_to_a_folder():
    for name in PACKAGED_MODELS:
        path = Path(resolve_model_path(name))
        assert path.is_dir(), name
        assert (path / "modules.json").is_file()
        assert (path / "tokenizer.json").is_file()
    assert resolve_model_path("all-MiniLM-L6-v2") == resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")


def test_other_names_pass_through():
    assert resolve_model_path("intfloat/e5-small-v2") == "intfloat/e5-small-v2"
    assert resolve_model_path("/models/local") == "/models/local"


def test_model_properties(minilm):
    assert minilm.dimension == 384
    assert minilm.max_seq_length == 256
    assert minilm.tokenizer.get_vocab() == minilm.model.tokenizer.get_vocab()  # a private copy of the same
    ids = minilm.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert len(ids) == 2


def test_model_loads_once():
    emb = Embedder(EmbedderSpec(type="sentence_transformer"))
    assert not emb._model.loaded  # construction is cheap: nothing loaded yet
    first = emb.model
    assert first is not None
    assert emb.model is first
    assert emb.tokenizer is emb.tokenizer and emb.tokenizer is not first.tokenizer  # copied once, kept
    emb.encode_documents(["x"])
    assert emb.model is first


def test_encode_shapes_and_dtype(minilm):
    docs = minilm.encode_documents(["a cat sat on the mat", "stock markets fell sharply", "third"])
    queries = minilm.encode_queries(["where did the cat sit?"])
    assert docs.shape == (3, 384)
    assert queries.shape == (1, 384)
    assert docs.dtype == np.float32 and queries.dtype == np.float32


def test_vectors_are_normalised(minilm):
    vectors = minilm.encode_documents(["one sentence", "a rather longer sentence about something else"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_empty_list(minilm):
    for out in (minilm.encode_documents([]), minilm.encode_queries([])):
        assert out.shape == (0, 384)
        assert out.dtype == np.float32


def test_semantics(minilm):
    q = minilm.encode_queries(["Where did the cat sit?"])[0]
    docs = minilm.encode_documents(["The cat sat on the mat.", "Stock markets fell sharply today."])
    sims = docs @ q
    assert sims[0] > sims[1] + 0.2


def test_encoding_is_deterministic_and_batch_independent(minilm):
    texts = ["alpha beta", "gamma delta epsilon", "zeta"]
    together = minilm.encode_documents(texts)
    alone = np.vstack([minilm.encode_documents([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_prefixes_are_applied(minilm):
    spec = EmbedderSpec(type="sentence_transformer", query_prefix="query: ", document_prefix="passage: ")
    prefixed = Embedder(spec)
    prefixed._model = minilm._model  # share the loaded weights; the prefixes are the embedder's job
    text = "penguins cannot fly"
    plain = minilm.encode_documents([text])[0]
    as_query = prefixed.encode_queries([text])[0]
    as_doc = prefixed.encode_documents([text])[0]
    # each side gets its own prefix...
    np.testing.assert_allclose(as_query, minilm.encode_documents(["query: " + text])[0], atol=1e-5)
    np.testing.assert_allclose(as_doc, minilm.encode_documents(["passage: " + text])[0], atol=1e-5)
    # ...which changes the vectors
    assert not np.allclose(as_query, plain, atol=1e-3)
    assert not np.allclose(as_doc, plain, atol=1e-3)
    assert not np.allclose(as_query, as_doc, atol=1e-3)
    # without prefixes queries and documents encode alike
    np.testing.assert_allclose(minilm.encode_queries([text])[0], plain, atol=1e-5)


def test_max_seq_length_override_truncates():
    emb = Embedder(EmbedderSpec(type="sentence_transformer", max_seq_length=16))
    assert emb.max_seq_length == 16
    long = "penguins in antarctica " * 20
    # tokens past the limit are ignored, so texts differing only after token 16 encode the same
    a, b = emb.encode_documents([long, long + " completely different ending about finance"])
    np.testing.assert_allclose(a, b, atol=1e-5)
    full = Embedder(EmbedderSpec(type="sentence_transformer"))
    x, y = full.encode_documents(["penguins " * 10, "penguins " * 10 + "stock market crash " * 5])
    assert not np.allclose(x, y, atol=1e-3)  # without the override the ending does count


def test_fingerprint_fields():
    fields = Embedder.fingerprint_fields(EmbedderSpec(type="sentence_transformer", device="cuda", batch_size=8,
                                                      query_prefix="q: ", document_prefix="p: "))
    assert set(fields) == {"model", "backend", "normalize", "max_seq_length", "document_prefix"}
    assert fields["document_prefix"] == "p: "


def test_spec_validation():
    with pytest.raises(ValueError):
        EmbedderSpec(type="sentence_transformer", backend="tensorrt")
    with pytest.raises(ValueError):
        EmbedderSpec(type="sentence_transformer", max_seq_length=4)
    with pytest.raises(ValueError):
        EmbedderSpec(type="sentence_transformer", unknown=True)


def test_chunking_and_encoding_can_run_in_parallel(minilm):
    """Pipelined ingestion chunks one batch while it embeds another: the tokenizer must not be shared."""
    from concurrent.futures import ThreadPoolExecutor

    assert minilm.tokenizer is not minilm.model.tokenizer
    texts = [("word " * n).strip() for n in range(1, 400, 7)]

    def tokenize() -> int:
        return sum(len(ids) for ids in minilm.tokenizer(texts, add_special_tokens=False, truncation=False)["input_ids"])

    with ThreadPoolExecutor(4) as pool:  # two encodes of a sixth of them keep the two overlapping, cheaply
        encodes = [pool.submit(minilm.encode_documents, texts[::6]) for _ in range(2)]
        counts = [pool.submit(tokenize) for _ in range(8)]
        assert all(f.result().shape == (len(texts[::6]), 384) for f in encodes)
        assert len({f.result() for f in counts}) == 1


def test_the_vectors_key_follows_what_makes_vectors_comparable():
    base = EmbedderSpec(type="sentence_transformer")
    for same in ({"batch_size": 8}, {"device": "cuda"}, {"backend": "onnx_int8"}, {"query_prefix": "query: "},
                 {"model": "sentence-transformers/all-MiniLM-L6-v2"}):
        assert base.model_copy(update=same).vectors_key() == base.vectors_key(), same
    for other in ({"model": "/models/adapted"}, {"normalize": False}, {"max_seq_length": 128},
                  {"document_prefix": "passage: "}):
        assert base.model_copy(update=other).vectors_key() != base.vectors_key(), other


def test_chunking_needs_the_tokenizer_not_the_model(minilm):
    """Issue 22.2: chunking one changed document loaded the whole model (~7 s); the tokenizer and the
    input limit come from the model folder, and give exactly what the loaded model's do."""
    cold = Embedder(EmbedderSpec(type="sentence_transformer"))
    texts = ["Aspirin reduces the risk of myocardial infarction.", "naïve café — ünïcode; 1,000 words?", ""]
    got = cold.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    assert not cold._model.loaded and cold.max_seq_length == minilm.max_seq_length == 256
    assert not cold._model.loaded
    want = minilm.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    assert got["input_ids"] == want["input_ids"] and got["offset_mapping"] == want["offset_mapping"]


def test_the_chunking_tokenizer_does_not_depend_on_whether_the_model_was_loaded_first(minilm):
    """A process that embedded before it chunks (the second batch of a run) must chunk as one that did
    not: the same tokenizer.json, not a copy of the loaded model's tokenizer (which transformers may
    rebuild from vocab.txt)."""
    from ragline.flows.resources.models.chunking_tokenizer import ChunkingTokenizer

    warm = Embedder(EmbedderSpec(type="sentence_transformer"))
    warm.encode_documents(["loaded first"])
    assert warm._model.loaded and isinstance(warm.tokenizer, ChunkingTokenizer)


def test_a_model_config_with_tokenizer_arguments_loads_the_model_for_its_tokenizer(tmp_path, minilm):
    """The shortcut reproduces only max_seq_length and do_lower_case; other arguments mean the model's own."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 128, "tokenizer_args": {}}')
    embedder = Embedder(EmbedderSpec(type="sentence_transformer", model=str(folder)))
    assert embedder.max_seq_length == 128 and embedder._model.loaded


def test_a_model_that_lowercases_its_input_chunks_with_the_models_own_tokenizer(tmp_path, minilm):
    """do_lower_case: sentence-transformers lowercases in front of the tokenizer, which the model
    folder's tokenizer.json does not: the chunker must count the tokens the model will see."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    config = folder / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": True}))
    embedder = Embedder(EmbedderSpec(type="sentence_transformer", model=str(folder)))
    text = "KAPOW İstanbul DNA"
    got = embedder.tokenizer([text], add_special_tokens=False)["input_ids"][0]
    assert embedder._model.loaded
    assert got == embedder.model.tokenizer([text], add_special_tokens=False)["input_ids"][0]



def test_within_one_query_a_text_is_encoded_once_and_no_step_can_change_the_shared_vector(minilm, monkeypatch):
    """A routed request is embedded by its classifier and again by dense retrieval: inside one
    query's run (QUERY_VECTORS, set by engine.run) the second use gets the first's vector, also
    from another step thread; outside it (another request) the text is encoded again."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    from ragline.flows.context import QUERY_VECTORS

    encoded: list[list[str]] = []
    original = minilm._encode_queries  # the query vectors' path (ONNX Runtime or torch, issue 38.1)
    monkeypatch.setattr(minilm, "_encode_queries", lambda texts: encoded.append(list(texts)) or original(texts))
    token = QUERY_VECTORS.set({})
    try:
        first = minilm.encode_queries(["which mat did the cat pick?"])
        first[0][:] = 0.0  # a step scribbles on its copy
        step_thread = contextvars.copy_context()
        with ThreadPoolExecutor(1) as pool:
            again = pool.submit(step_thread.run, minilm.encode_queries,
                                ["which mat did the cat pick?", "a different question about dogs?"]).result()
    finally:
        QUERY_VECTORS.reset(token)
    assert encoded == [["which mat did the cat pick?"], ["a different question about dogs?"]]
    np.testing.assert_allclose(again[0], original(["which mat did the cat pick?"])[0], atol=1e-6)
    assert again.dtype == np.float32 and again.flags.writeable
    minilm.encode_queries(["which mat did the cat pick?"])  # the next request: its own
    assert encoded[-1] == ["which mat did the cat pick?"]


def bulk_encode_growth_mb() -> int:
    """The RSS a process keeps after two bulk encodes on fresh threads (after one warm-up encode), in MB."""
    texts = ["word " * 200 + str(i) for i in range(32)]  # one encode batch, ~90 MB of activations
    embedder = Embedder(EmbedderSpec(type="sentence_transformer"))
    embedder.encode_documents(texts[:2])
    before = psutil.Process().memory_info().rss
    for _ in range(2):
        worker = threading.Thread(target=embedder.encode_documents, args=(texts,))
        worker.start()
        worker.join()
    return (psutil.Process().memory_info().rss - before) >> 20


@pytest.mark.integration  # a fresh interpreter with the model loaded
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_bulk_encode_on_another_thread_leaves_no_activations_behind(tmp_path):
    """A pipelined ingestion encodes each batch on whichever pool thread is free; without
    return_freed_memory each thread's malloc arena kept ~90 MB of this encode's activations.
    Measured in a fresh interpreter: in a test worker, threads earlier tests left allocate inside
    the window (CI: 50 MB)."""
    assert in_a_fresh_process(f"{__name__}:bulk_encode_growth_mb", result=tmp_path / "growth.json") < 45
