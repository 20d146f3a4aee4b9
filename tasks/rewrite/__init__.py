"""Query understanding before retrieval: rewriting (HyDE, multi-query, RAG-fusion, query2doc),
term and pseudo-relevance expansion, self-querying filters, routing (``classify``) and the
conversation's history made standalone (``recall_history``)."""
