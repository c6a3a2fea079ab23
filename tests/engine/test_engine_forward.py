"""The engine's forward path: what crosses to the device each iteration,
how many attention calls and plans it makes, how often the host waits, and
decode iterations replayed from captured graphs (on the CPU with a stand-in
graph and torch's FlashAttention-2 op replaced by its reference; the real
capture on a GPU)."""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

from engine import engine_models  # noqa: E402
from engine.engine_models import VOCAB, alone, tiny_llama  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vattn.engine import Engine  # noqa: E402
from vattn.engine import engine as engine_module  # noqa: E402
from vattn.engine import graphs as graphs_module  # noqa: E402
from vattn.kernels import KERNELS, AttentionBatch  # noqa: E402
from vattn.kernels import batch as batch_module  # noqa: E402

PAGE = 4096
LAYERS = 3
CUDA_REASON = "needs a CUDA GPU: real pinned copies and CUDA graph captures"


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(LAYERS)


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    return engine_models.workload(n, seed, prompt_tokens=(3, 40), new_tokens=(2, 12))


@pytest.fixture(scope="module")
def reference(model):
    prompts, news = workload(7, seed=3)
    return prompts, news, [alone(model, p, n) for p, n in zip(prompts, news)]


# ---- what crosses to the device -------------------------------------------------


class FakeDevice:
    """pinned_host and to_device replaced for a 'cuda' device on a CPU-only
    machine: the 'pinned' tensors are marked, every copy is recorded, the
    'device' tensor is the host one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pinned: set[int] = set()
        self.copies: list[tuple[bool, torch.device]] = []  # (source pinned, device) per copy
        monkeypatch.setattr(batch_module, "pinned_host", self.pinned_host)
        monkeypatch.setattr(batch_module, "to_device", self.to_device)

    def pinned_host(self, values, dtype):
        host = torch.tensor(values, dtype=dtype)
        self.pinned.add(id(host))
        return host

    def to_device(self, host, device):
        self.copies.append((id(host) in self.pinned, device))
        return host


def test_to_device_copies_without_blocking():
    calls = []

    class Host:
        def to(self, *args, **kwargs):
            calls.append((args, kwargs))
            return "on the device"

    assert batch_module.to_device(Host(), torch.device("cuda")) == "on the device"
    assert calls == [((torch.device("cuda"),), {"non_blocking": True})]


def test_a_batchs_index_tensors_cross_in_one_pinned_copy(monkeypatch):
    fake = FakeDevice(monkeypatch)
    batch = AttentionBatch([3, 1], [5, 0], [1, 4], device="cuda")
    starts, lens, reqids = batch.tensors(("query_starts", "seq_lens", "reqids"))
    assert (starts.tolist(), lens.tolist(), reqids.tolist()) == ([0, 1, 5], [6, 4], [3, 1])
    assert batch_module.token_rows(batch)[1].tolist() == [5, 0, 1, 2, 3]
    assert fake.copies == [(True, torch.device("cuda"))] * 2  # one per call that built tensors
    batch.tensors(("reqids",))
    assert len(fake.copies) == 2  # built once per batch
    cpu = AttentionBatch([0], [0], [2])
    cpu.tensors(("reqids", "seq_lens"))
    assert len(fake.copies) == 2  # on the CPU nothing is copied


@pytest.fixture
def device_placements(monkeypatch):
    """Every torch.tensor(..., device=...) and Tensor.to(...) onto a device
    that is not the CPU, as they happen (torch.tensor and Tensor.to wrapped)."""
    seen = []
    real_tensor, real_to = torch.tensor, torch.Tensor.to

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            seen.append(("torch.tensor", kwargs["device"]))
            kwargs = dict(kwargs, device="cpu")
        return real_tensor(*args, **kwargs)

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type != "cpu":
            seen.append(("Tensor.to", target))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


def test_a_step_reaches_the_device_only_through_pinned_non_blocking_copies(model, reference, monkeypatch,
                                                                          device_placements):
    """The forward path of an engine whose inputs go to 'cuda' (the cache and
    the model stay on the CPU: a CPU build of torch has no CUDA): its inputs
    and index tensors all cross through to_device, from pinned memory; no
    torch.tensor(..., device=) or .to(device) of its own remains."""
    prompts, news, expected = reference
    fake = FakeDevice(monkeypatch)
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as engine:
        engine._input_device = torch.device("cuda")
        assert engine.generate(prompts, max_new_tokens=news) == expected
        iterations = engine.iteration
    assert device_placements == []
    # the inputs (token ids, positions, rows to sample) cross in one copy per iteration
    assert fake.copies == [(True, torch.device("cuda"))] * iterations


def test_the_host_waits_for_the_device_once_per_step(model, reference, monkeypatch):
    """Sampling brings every token id of an iteration back in one tolist; no
    .item(), int() or bool() of a tensor in the engine's step (greedy and
    sampled requests, n > 1)."""
    prompts, news, _ = reference
    waits = collections.Counter()
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__int__", "__bool__", "__index__")}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            waits[name] += 1
            return real[name](self, *args, **kwargs)
        return wrapper

    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as engine:
        engine.add_request(prompts[0], max_new_tokens=6, temperature=0.9, top_p=0.8, seed=1, n=2)
        engine.add_request(prompts[1], max_new_tokens=5)
        engine.add_request(prompts[2], max_new_tokens=4, temperature=1.2, seed=3)
        with monkeypatch.context() as patch:
            for name in real:
                patch.setattr(torch.Tensor, name, counting(name))
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
    assert waits == {"tolist": steps}


def test_one_attention_call_per_layer_and_one_plan_per_iteration(model, reference, monkeypatch):
    """Prefill, decode and mixed iterations alike: the kernel is planned once
    per iteration, with the cache's mapping check built once (cache=kv), and
    run once per layer."""
    prompts, news, expected = reference
    with Engine(model, max_batch_size=3, max_context_len=128, page_size=PAGE, prefill_chunk_size=16) as engine:
        kernel, kv = engine._kernel, engine.kv
        counts = collections.Counter()
        kinds = collections.Counter()
        real_plan, real_run, real_check = kernel.plan, kernel.run, kv.mapped_check

        def plan(batch, case=None):
            counts["plan"] += 1
            kinds["decode" if batch.is_decode else "prefill" if not any(batch.cached_lens) else "mixed"] += 1
            return real_plan(batch, case)

        def run(*args, **kwargs):
            counts["run"] += 1
            return real_run(*args, **kwargs)

        def mapped_check(*args, **kwargs):
            counts["mapped_check"] += 1
            return real_check(*args, **kwargs)

        monkeypatch.setattr(kernel, "plan", plan)
        monkeypatch.setattr(kernel, "run", run)
        monkeypatch.setattr(kv, "mapped_check", mapped_check)
        for p, n in zip(prompts, news):
            engine.add_request(p, n)
        outputs = {}
        while engine.has_unfinished():
            before = dict(counts)
            finished = engine.step()
            ran = engine.history[-1]["tokens"] > 0
            assert counts["plan"] - before.get("plan", 0) == ran
            assert counts["mapped_check"] - before.get("mapped_check", 0) == ran
            assert counts["run"] - before.get("run", 0) == LAYERS * ran
            outputs.update({out.request_id: out.output for out in finished})
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert all(kinds[k] for k in ("prefill", "decode", "mixed")), kinds


# ---- decode graphs ----------------------------------------------------------------


def test_capture_sizes():
    assert graphs_module.capture_sizes(1) == (1,)
    assert graphs_module.capture_sizes(5) == (1, 2, 4, 5)
    assert graphs_module.capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert graphs_module.capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graphs_module.capture_sizes(8, [4, 1, 4]) == (1, 4)
    for bad in ([], [0], [9], [2.0], [True], "4"):
        with pytest.raises(ValueError, match=r"graph_batch_sizes .*\[1, 8\]"):
            graphs_module.capture_sizes(8, bad)


def test_graph_options_are_checked(model):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device, got cpu"):
        Engine(model, max_batch_size=2, max_context_len=64, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool or None"):
        Engine(model, max_batch_size=2, max_context_len=64, cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"graph_batch_sizes must hold ints in \[1, 2\]"):
        Engine(model, max_batch_size=2, max_context_len=64, graph_batch_sizes=[3])
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 0"):
        Engine(model, max_batch_size=0, max_context_len=64)
    with Engine(model, max_batch_size=2, max_context_len=64) as engine:
        assert engine.graphs is None and engine.stats()["decode_graph_replays"] is None  # off on the CPU
        assert engine.kv.config.max_batch_size == 2  # no padding reqid


class EagerGraph:
    """CudaGraph's stand-in on the CPU: capture runs the forward once inside
    ``kv.graph_capture()`` and keeps it; replay runs it again into the
    captured output, reading the tensors the capture read (the persistent
    buffers), as a replayed CUDA graph does."""

    made: list[EagerGraph] = []

    def __init__(self, pool) -> None:
        self.replays = 0
        EagerGraph.made.append(self)

    def capture(self, run, kv):
        with kv.graph_capture():  # the mapper's round in flight lands on entry; nothing maps after
            mapped = kv.stats()["page_mappings"]
            self.output = run()
            assert kv.stats()["page_mappings"] == mapped, "a capture mapped pages"
        self.run = run
        return self.output

    def replay(self):
        with torch.inference_mode():
            self.output.copy_(self.run())
        self.replays += 1


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Decode graphs on the CPU: the stand-in graph, and torch's
    FlashAttention-2 (a kernel that plans into persistent buffers) with its op
    replaced by the reference of its varlen contract."""
    from kernels.kernel_references import install_torch_flash

    calls = install_torch_flash(monkeypatch)
    monkeypatch.setattr(graphs_module, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(graphs_module, "GRAPH_TYPE", EagerGraph)
    monkeypatch.setattr(engine_module, "select_kernel", lambda case: KERNELS["torch_flash"])
    EagerGraph.made = []
    return calls


def test_decode_iterations_replay_padded_graphs(model, reference, graphs_on_cpu):
    """Sizes 1 and 3 of a batch of 4: a decode of 2 replays size 3 (one
    padded row), a decode of 4 runs eagerly, prefills eagerly; the outputs
    are those of each request alone, and of the engine without graphs."""
    prompts, news, expected = reference
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE, cuda_graphs=True,
                graph_batch_sizes=[3, 1]) as engine:
        graphs = engine.graphs
        assert graphs.sizes == (1, 3) and [g.output.shape[0] for g in EagerGraph.made] == [3, 1]  # largest first
        padding = graphs.padding_reqid
        assert padding == 4 and engine.kv.config.max_batch_size == 5
        assert (graphs.size_for(1), graphs.size_for(2), graphs.size_for(3), graphs.size_for(4)) == (1, 3, 3, None)
        addresses = (graphs.buffers.block_table.data_ptr(), graphs.input_ids.data_ptr(), graphs.seqused_k.data_ptr())
        decodes = collections.Counter()
        real_run = graphs.run

        def run(batch, tokens, positions):
            assert padding not in batch.reqids  # no request gets the padding slice
            logits = real_run(batch, tokens, positions)
            decodes["replayed" if logits is not None else "eager"] += 1
            if logits is not None:
                size = graphs.size_for(len(tokens))
                assert graphs.seqused_k[:size].tolist() == batch.seq_lens + [1] * (size - len(tokens))
                assert graphs.buffers.block_table[:size].tolist() == batch.reqids + [padding] * (size - len(tokens))
                # the same decode run eagerly (it writes the same K/V again) gives the same logits
                ids = torch.tensor([tokens + positions])
                eager = engine._run_model(engine._kernel.plan(batch, engine._case), ids[:, :len(tokens)],
                                          ids[:, len(tokens):])
                torch.testing.assert_close(logits, eager)
            return logits

        graphs.run = run
        outputs = engine.generate(prompts, max_new_tokens=news)
        assert outputs == expected
        assert max(h["running"] for h in engine.history) == 4  # the padding reqid is not a request's
        assert decodes["replayed"] == engine.stats()["decode_graph_replays"] == sum(g.replays for g in EagerGraph.made)
        assert decodes["replayed"] > 0 and decodes["eager"] > 0
        assert all(g.replays for g in EagerGraph.made)  # both sizes served decodes
        assert (graphs.buffers.block_table.data_ptr(), graphs.input_ids.data_ptr(),
                graphs.seqused_k.data_ptr()) == addresses
        assert engine.kv.is_allocated(padding) and engine.kv.mapped_tokens(padding) >= 1
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE, cuda_graphs=False) as eager:
        assert eager.graphs is None
        assert eager.generate(prompts, max_new_tokens=news) == expected


def test_padded_rows_touch_only_the_padding_slice(model, graphs_on_cpu):
    """A decode of 1 request replayed at size 3: the two padded tokens write
    row 0 of the padding slice and nothing else; the request's rows hold what
    the eager engine writes."""
    prompt = list(range(2, 30))
    with Engine(model, max_batch_size=3, max_context_len=64, page_size=PAGE, cuda_graphs=True,
                graph_batch_sizes=[3]) as engine:
        padding = engine.graphs.padding_reqid
        k0 = engine.kv.layer(0)[0]
        mapped = engine.kv.mapped_tokens(padding)
        assert mapped > 1
        k0[padding, :mapped] = 7.0
        engine.add_request(prompt, max_new_tokens=3)
        while engine.has_unfinished():
            engine.step()
        assert engine.stats()["decode_graph_replays"] == 2
        rows = k0[0, :len(prompt) + 2].clone()
        assert (k0[padding, 0] != 7.0).all()  # written by the padding
        assert (k0[padding, 1:mapped] == 7.0).all()  # and nothing else of the slice
        for layer in range(LAYERS):  # each padded row read one key, the one it wrote: finite values throughout
            assert all(torch.isfinite(t[padding, 0]).all() for t in engine.kv.layer(layer))
    with Engine(model, max_batch_size=3, max_context_len=64, page_size=PAGE, cuda_graphs=False) as eager:
        eager.add_request(prompt, max_new_tokens=3)
        while eager.has_unfinished():
            eager.step()
        torch.testing.assert_close(eager.kv.layer(0)[0][0, :len(prompt) + 2], rows)


# ---- on a GPU ----------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_index_tensors_are_copied_from_pinned_memory_on_a_gpu(monkeypatch):
    sources = []
    real = batch_module.to_device
    monkeypatch.setattr(batch_module, "to_device", lambda host, device: sources.append(host) or real(host, device))
    batch = AttentionBatch([2, 0], [3, 0], [1, 2], device="cuda")
    reqids, starts = batch.tensors(("reqids", "query_starts"))
    assert reqids.is_cuda and reqids.tolist() == [2, 0] and starts.tolist() == [0, 1, 3]
    assert len(sources) == 1 and sources[0].is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_decode_graphs_on_a_gpu_equal_eager_decodes():
    """The real capture and replay (torch's FlashAttention-2 or the flash-attn
    package, bf16): every replayed decode's logits are those of the same
    decode run eagerly (padded GEMMs may round differently: bf16 tolerances)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      eos_token_id=None)
    gpu_model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    prompts, news = workload(6, seed=4)
    with Engine(gpu_model, max_batch_size=4, max_context_len=512, graph_batch_sizes=[1, 3],
                sync_streams=torch.cuda.current_stream()) as engine:
        graphs = engine.graphs
        assert graphs is not None, "graphs are on by default on CUDA"
        real_run = graphs.run
        compared = []

        def run(batch, tokens, positions):
            logits = real_run(batch, tokens, positions)
            if logits is not None:
                ids = torch.tensor([tokens + positions], device="cuda")
                eager = engine._run_model(engine._kernel.plan(batch, engine._case), ids[:, :len(tokens)],
                                          ids[:, len(tokens):])
                torch.testing.assert_close(logits.float(), eager.float(), atol=5e-2, rtol=5e-2)
                compared.append(len(tokens))
            return logits

        graphs.run = run
        outputs = engine.generate(prompts, max_new_tokens=news)
        assert [len(o) for o in outputs] == news
        assert engine.generate(prompts[:2], max_new_tokens=3)  # decodes of 2 requests: padded to size 3
        assert engine.stats()["decode_graph_replays"] == len(compared) > 0
        assert 2 in compared
