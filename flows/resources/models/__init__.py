"""The models stages share, each loaded once per process: the embedder (sentence-transformers, or
its ONNX export: ``onnx_backend``, ``onnx_query``, ``onnx_files``), the cross-encoder, the chunking
tokenizer, and the LLM client (``llm``) with its oldest-query-first lanes (``fair_slots``) and the
parsing of what it returns (``llm_output``)."""
