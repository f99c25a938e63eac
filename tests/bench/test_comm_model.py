"""Communication model of loom analyze's parallel layouts (loom/bench/comm.py) on hand-computed cases."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pytest

from loom.bench.analyze import Workload, parallel_summary, to_json
from loom.bench.comm import (
    LOOPBACK_DEFAULT,
    Interconnect,
    OpLink,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    interconnect,
    load_link_profile,
    predict,
    send_time,
    shard_arch,
    step_comm,
)
from loom.bench.model_arch import ModelArch
from loom.bench.probe import MachineSpec
from loom.bench.roofline import Roofline

LINK = Interconnect("test", bandwidth=1e9, latency=1e-6)  # 1 GB/s, 1 us
MACHINE = MachineSpec(bandwidth=10e9, flops=100e9, dtype="float32", threads=2, source="given")


def tiny() -> ModelArch:
    # L=2, d=8, H=4, H_kv=2, d_h=2, F=16, V=10, tied
    return ModelArch(name="tiny", num_layers=2, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2,
                     intermediate_size=16, vocab_size=10, tie_word_embeddings=True, max_position_embeddings=64)


def smol() -> ModelArch:
    return ModelArch(name="smol", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                     max_position_embeddings=8192)


def test_collective_formulas_by_hand() -> None:
    # p=2 ring all-reduce of 1000 B: 2·(1/2)·1000/1e9 + 2·1·1e-6 = 1 us + 2 us
    assert all_reduce_time(1000, 2, LINK) == pytest.approx(3e-6)
    # p=4: 2·(3/4)·1000/1e9 + 2·3·1e-6 = 1.5 us + 6 us
    assert all_reduce_time(1000, 4, LINK) == pytest.approx(7.5e-6)
    # all-gather of a 4000 B output over 4 ranks: (3/4)·4000/1e9 + 3 us
    assert all_gather_time(4000, 4, LINK) == pytest.approx(6e-6)
    assert send_time(1000, LINK) == pytest.approx(2e-6)
    assert all_to_all_time(4000, 4, LINK) == pytest.approx(6e-6)
    assert all_reduce_time(1000, 1, LINK) == all_gather_time(1000, 1, LINK) == 0.0


def test_per_op_constants_replace_the_links() -> None:
    link = Interconnect("fit", 1e9, 1e-6, (OpLink("all_gather", 2e9, 5e-6),))
    assert all_gather_time(4000, 2, link) == pytest.approx(2000 / 2e9 + 5e-6)
    assert all_reduce_time(1000, 2, link) == pytest.approx(3e-6)


def test_tiny_tp2_decode_bytes_by_hand() -> None:
    comm = step_comm(tiny(), 2, 1, tokens=3, sampled_rows=3, activation_bytes=4, link=LINK)
    by_what = {i.what.split()[0]: i for i in comm.items}
    layers, embed, logits = by_what["o_proj"], by_what["vocab-parallel"], by_what["logits"]
    assert (layers.messages, layers.message_bytes) == (4, 3 * 8 * 4)  # 2 per layer of [3, 8] float32
    assert (embed.messages, embed.message_bytes) == (1, 96)
    assert (logits.messages, logits.message_bytes) == (1, 3 * 2 * 5 * 4)  # 3 rows, 2 ranks x 5 vocab columns
    assert comm.bytes == 4 * 96 + 96 + 120 == 600
    assert comm.time_s == pytest.approx(5 * (96 / 1e9 + 2e-6) + (60 / 1e9 + 1e-6))


def test_pipeline_sends_and_slots_by_hand() -> None:
    # PP=2, m=2 micro-batches of 2 sequences: hops on the critical path m + M - 2 = 2, 2 tensors each
    comm = step_comm(tiny(), 1, 2, tokens=4, sampled_rows=4, activation_bytes=4, link=LINK, micro_batches=2)
    (send,) = comm.items
    assert (send.op, send.messages, send.message_bytes) == ("send", 4, 2 * 8 * 4)
    # TP=2 x PP=2: each of the m + M - 1 = 3 slots runs ceil(2/2) = 1 layer's 2 all-reduces
    both = step_comm(tiny(), 2, 2, tokens=4, sampled_rows=4, activation_bytes=2, link=LINK, micro_batches=2)
    assert both.items[0].messages == 6 and both.items[0].message_bytes == 2 * 8 * 2


def test_no_parallelism_is_no_communication_and_the_old_floors() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    assert step_comm(smol(), 1, 1, 7, 7, 4, LINK).items == ()
    pred = predict(roof, batch=4, context=100, prompt_len=64, tensor_parallel_size=1, pipeline_parallel_size=1,
                   link=LINK, activation_bytes=4)
    assert pred.shard == smol()
    assert pred.decode.time_s == roof.decode_step_floor(4, 100)
    assert pred.prefill.time_s == roof.prefill_floor(64)
    assert pred.decode.bubble_fraction == pred.prefill.bubble_fraction == 0
    assert pred.decode_tok_s == pytest.approx(roof.decode_throughput_ceiling(4, 100))


def test_shard_follows_the_engines_head_split() -> None:
    two = shard_arch(smol(), 2)  # 3 KV heads over 2 ranks: the first holds 2, with their 6 query heads
    assert (two.num_kv_heads, two.num_heads, two.intermediate_size, two.vocab_size) == (2, 6, 768, 24576)
    three = shard_arch(smol(), 3)
    assert (three.num_kv_heads, three.num_heads) == (1, 3)
    four = shard_arch(tiny(), 4)  # fewer KV heads than ranks: one replicated KV head, H/N query heads
    assert (four.num_kv_heads, four.num_heads) == (1, 1)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        shard_arch(tiny(), 3)


def test_tp_halves_the_shard_and_pp_adds_a_bubble() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    tp2 = predict(roof, 1, 0, 64, 2, 1, LINK, 4)
    shard = Roofline(tp2.shard, MACHINE, 4.0, 4.0)
    assert 0.5 < shard.weight_bytes / roof.weight_bytes < 0.6  # uneven KV heads: 2 of 3 on the busiest rank
    assert tp2.decode.compute_s == pytest.approx(shard.decode_step_floor(1, 0))
    assert tp2.decode.time_s == pytest.approx(tp2.decode.compute_s + tp2.decode.comm.time_s)
    pp = predict(roof, 2, 0, 64, 1, 2, LINK, 4)  # m = min(M, B) = 2: bubble (M-1)/(m+M-1) = 1/3
    assert pp.decode.micro_batches == 2 and pp.decode.bubble_fraction == pytest.approx(1 / 3)
    # 3 slots, each one micro-batch of 1 sequence through 15 of 30 layers
    assert pp.decode.compute_s == pytest.approx(3 * 0.5 * roof.decode_step_floor(1, 0))
    one = predict(roof, 1, 0, 64, 1, 4, LINK, 4)  # one sequence: m = 1, each stage idle 3/4 of the step
    assert one.decode.bubble_fraction == pytest.approx(0.75)
    assert one.prefill.compute_s == pytest.approx(4 * math.ceil(30 / 4) / 30 * roof.prefill_floor(64))


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"name": "infiniband"}, "--interconnect"),
    ({"name": "nvlink", "bandwidth_gbs": -1.0}, "--link-bandwidth-gbs"),
    ({"name": "pcie", "latency_us": -3.0}, "--link-latency-us"),
    ({"name": "loopback", "profile": Path("/nonexistent/comm.json")}, "--link-profile"),
])
def test_bad_link_flags_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        interconnect(**kwargs)


def test_bad_sizes_name_the_flag() -> None:
    roof = Roofline.build(tiny(), MACHINE, "float32", "float32")
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        predict(roof, 1, 0, 8, 0, 1, LINK, 4)
    with pytest.raises(ValueError, match="--pipeline-parallel-size"):
        predict(roof, 1, 0, 8, 1, 0, LINK, 4)
    with pytest.raises(ValueError, match="bandwidth"):
        Interconnect("x", -1.0, 0.0)


def test_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli import main

    base = ["analyze", "--bandwidth-gbs", "10", "--gflops", "100", "--dtype", "float32"]
    with pytest.raises(SystemExit):
        main([*base, "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--tensor-parallel-size", "2", "--interconnect", "infiniband"])
    assert "--interconnect" in capsys.readouterr().err
    plain = tmp_path / "plain.json"
    assert main([*base, "--json", str(plain)]) == 0
    assert "tensor_parallel_size" not in capsys.readouterr().out
    assert set(json.loads(plain.read_text())) == {"floors", "efficiency"}
    par = tmp_path / "par.json"
    assert main([*base, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--interconnect", "nvlink",
                 "--link-bandwidth-gbs", "100", "--json", str(par)]) == 0
    out = capsys.readouterr().out
    assert "predicted_tpot_ms_B1_C0" in out and "hidden state and residual" in out
    doc = json.loads(par.read_text())
    assert doc["parallel"]["link_bandwidth_GBps"] == 100
    assert {i["op"] for i in doc["communication"]["decode"]} == {"all_reduce", "all_gather", "send"}


def test_link_profile_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "comm.json"
    path.write_text(json.dumps({"fit": {"joint": {"latency_s": 4e-5, "bandwidth_Bps": 2e9},
                                        "per_op": {"send": {"latency_s": 3e-5, "bandwidth_Bps": 3e9}}}}))
    link, source = interconnect("loopback", profile=path)
    assert (link.bandwidth, link.latency) == (2e9, 4e-5) and link.for_op("send") == (3e9, 3e-5)
    assert str(path) in source
    given, _ = interconnect("loopback", bandwidth_gbs=5.0, profile=path)
    assert given.bandwidth == 5e9 and given.per_op == ()
    assert load_link_profile(path).for_op("all_reduce") == (2e9, 4e-5)


def test_summary_and_json_keys() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    pred = predict(roof, 4, 10, 32, 2, 1, LINK, 4)
    work = Workload(4, 10, 32, 1.0, 64)
    summary = parallel_summary(pred, work, "preset")
    assert summary["predicted_tpot_ms_B4_C10"] == pytest.approx(pred.decode.time_s * 1e3)
    assert json.loads(to_json({}, [], (summary, pred)))["communication"]["prefill"][0]["op"] == "all_reduce"


def _gloo_rank(rank: int, port: int, queue: object) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(576 * 16)  # 16 tokens of the bundled model's hidden state, float32: 36,864 bytes
    times = []
    for i in range(25):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put((statistics.median(times), x[0].item()))  # type: ignore[attr-defined]
    dist.destroy_process_group()


@pytest.mark.timeout(20)
def test_gloo_all_reduce_on_loopback_is_the_models_order_of_magnitude() -> None:
    """One small 2-process check: gloo's all-reduce of a step-sized message takes the model's order of time (a
    loose bound: the suite shares this machine's two cores; benchmarks/comm_bench.py does the measurement)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    median_s, value = queue.get(timeout=15)
    for p in procs:
        p.join(timeout=5)
    assert value == 2.0 ** 25  # 25 sums of two ranks' tensors
    predicted = all_reduce_time(576 * 16 * 4, 2, LOOPBACK_DEFAULT)
    assert predicted / 10 < median_s < predicted * 50


def test_analyze_refuses_more_stages_than_layers_and_a_profile_for_another_link(capsys) -> None:
    from loom.cli import main

    base = ["analyze", "--bandwidth-gbs", "28", "--gflops", "363"]
    with pytest.raises(SystemExit) as stages:
        main([*base, "-pp", "31", "--interconnect", "nvlink"])
    assert stages.value.code == 2 and "31 exceeds the model's 30 layers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as profile:
        main([*base, "-tp", "2", "--interconnect", "nvlink", "--link-profile", "missing.json"])
    assert profile.value.code == 2 and "no effect with --interconnect nvlink" in capsys.readouterr().err
