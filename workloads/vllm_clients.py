"""OpenAI clients against a vLLM API server, for tests/integrations/test_vllm_serve.py.

Runs under the interpreter of the vLLM environment (the ``openai`` package
comes with vLLM):

    python workloads/vllm_clients.py BASE_URL MODEL SPEC.json OUT.json

SPEC: ``prompts`` (texts), ``max_tokens``, ``concurrency`` (clients at once),
``rounds`` (how many times the prompts are sent). Every prompt is sent as a
plain completion, a streamed completion and a completion with ``n=2``, greedy
(temperature 0; ``n=2``: top-k 1, as vLLM refuses ``n > 1`` at temperature 0),
``ignore_eos`` so every answer has ``max_tokens`` tokens.
``connection_retries`` (default 0): how many times a request whose
connection failed before any answer (the ``openai`` client's
``APIConnectionError``) is sent again, as the ``openai`` client's own
retries would; nothing else is retried (an error answer is a failure).
OUT: per kind, the texts in prompt order (each round's; ``n=2``: both
choices), the errors (any failed request), the connections retried, and
the seconds the run took.

A SPEC with ``requests`` instead (:func:`timed`) sends each of them once
as a plain greedy completion and times it: each is ``{"tag", "prompt"
(text or token ids), "max_tokens", "delay_s" (seconds after the start it
is sent, default 0)}``, ``concurrency`` clients at once. OUT:
``answers``, one per request in SPEC's order: its tag, when it was sent
and answered (seconds after the start), and its text or its error (the
exception's type, the HTTP status when there was an answer, the
message); the seconds the run took, and ``time.monotonic()`` at its
start (``started_monotonic_s``: CLOCK_MONOTONIC, the same in every process).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def run(base_url: str, model: str, spec: dict) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    greedy = dict(model=model, max_tokens=spec["max_tokens"], temperature=0, extra_body={"ignore_eos": True})

    def plain(prompt: str) -> list[str]:
        return [client.completions.create(prompt=prompt, **greedy).choices[0].text]

    def streamed(prompt: str) -> list[str]:
        parts = [chunk.choices[0].text for chunk in client.completions.create(prompt=prompt, stream=True, **greedy)
                 if chunk.choices]
        return ["".join(parts)]

    def two(prompt: str) -> list[str]:
        # vLLM refuses n > 1 with temperature 0; top_k=1 samples the greedy token all the same
        sampled = dict(greedy, temperature=1.0, extra_body=dict(greedy["extra_body"], top_k=1))
        choices = client.completions.create(prompt=prompt, n=2, **sampled).choices
        return [c.text for c in sorted(choices, key=lambda c: c.index)]

    kinds = {"plain": plain, "stream": streamed, "n2": two}
    jobs = [(kind, r, i, p) for r in range(spec.get("rounds", 1)) for i, p in enumerate(spec["prompts"])
            for kind in kinds]
    out: dict = {kind: {} for kind in kinds}
    errors: list[str] = []

    from openai import APIConnectionError

    retried: list[str] = []

    def one(job: tuple) -> None:
        kind, r, i, prompt = job
        for attempt in range(spec.get("connection_retries", 0) + 1):
            try:
                out[kind][f"{r}:{i}"] = kinds[kind](prompt)
                return
            except APIConnectionError as e:  # the connection failed before any answer: sent again, if allowed
                if attempt == spec.get("connection_retries", 0):
                    errors.append(f"{kind} {r}:{i}: {type(e).__name__}: {e}")
                else:
                    retried.append(f"{kind} {r}:{i}")
            except Exception as e:  # noqa: BLE001 - every failure is reported, none may happen
                errors.append(f"{kind} {r}:{i}: {type(e).__name__}: {e}")
                return

    start = time.monotonic()
    with ThreadPoolExecutor(spec.get("concurrency", 4)) as pool:
        list(pool.map(one, jobs))
    return {"texts": out, "errors": errors, "retried": retried, "seconds": time.monotonic() - start}


def timed(base_url: str, model: str, spec: dict) -> dict:
    """Each of ``spec["requests"]`` once, as a plain greedy completion (no retries): when it was sent and
    answered, and its text or its error (a failed connection included), in seconds from the start."""
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    start = time.monotonic()

    def one(request: dict) -> dict:
        time.sleep(max(0.0, start + request.get("delay_s", 0.0) - time.monotonic()))
        answer = dict(tag=request["tag"], sent_s=time.monotonic() - start)
        try:
            completion = client.completions.create(model=model, prompt=request["prompt"],
                                                   max_tokens=request["max_tokens"], temperature=0,
                                                   extra_body={"ignore_eos": True})
            answer.update(text=completion.choices[0].text, finish_reason=completion.choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - every failure is the caller's to judge
            answer["error"] = dict(type=type(e).__name__, message=str(e),
                                   status=e.status_code if isinstance(e, APIStatusError) else None)
        answer["answered_s"] = time.monotonic() - start
        return answer

    with ThreadPoolExecutor(spec.get("concurrency", 4)) as pool:
        answers = list(pool.map(one, spec["requests"]))
    return {"answers": answers, "seconds": time.monotonic() - start, "started_monotonic_s": start}


if __name__ == "__main__":
    url, name, spec_path, out_path = sys.argv[1:]
    with open(spec_path) as f:
        spec = json.load(f)
    result = timed(url, name, spec) if "requests" in spec else run(url, name, spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
