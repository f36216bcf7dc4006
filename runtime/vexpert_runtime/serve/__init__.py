"""``vexpert serve``: an OpenAI-compatible API through the vExpert MoE path (issue #13).

Each EP rank is also a data-parallel attention rank: it runs the model's non-expert layers for its
own requests and the vExpert EP MoE layer across ranks in lockstep.

* :mod:`.step` — the contract between the scheduler and a model (:class:`StepModel`);
* :mod:`.hf_model` — Hugging Face transformers models run step by step, MoE blocks handed to an executor;
* :mod:`.demo_model` — a small random DeepSeek-V3 checkpoint with a local tokenizer, for demos and tests;
* :mod:`.scheduler`, :mod:`.sampling` — continuous batching, KV budget, sampling and stop handling;
* :mod:`.events` — the picklable data between the API and the ranks (requests, events, loads, refusals);
* :mod:`.dispatcher` — the API's interface to the ranks, and the in-process (single-rank) implementation;
* :mod:`.openai_api`, :mod:`.api` — the OpenAI request/response types and the HTTP server.
"""
