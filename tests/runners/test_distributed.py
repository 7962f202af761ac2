"""runners.distributed on real processes: the launcher tears a group down when a rank dies, the collectives count
their payload bytes exactly, and the interface counters come from the kernel's /proc/net/dev."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from runners.distributed import RankEnv, counter_delta, free_port, interface_counters, launch
from tests.runners._rank_worker import COUNT_TENSORS

REPO = Path(__file__).resolve().parents[2]
WORKER = "tests.runners._rank_worker"
# The worker module lives in the test package: make it importable whatever the caller's working directory.
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _log_tail(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(log_dir.glob("*.log")))


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_tears_the_group_down_when_a_rank_dies(tmp_path: Path) -> None:
    # Rank 1 joins the group and exits(3); ranks 0, 2, 3 wait in an all-reduce whose timeout is 10 s.
    result = launch(WORKER, ["die", "1", "3", "10"], 4, env=ENV, log_dir=tmp_path)
    assert result.seconds < 45, _log_tail(tmp_path)
    assert result.failed_rank == 1, (result, _log_tail(tmp_path))
    assert result.returncodes[1] == 3
    assert all(rc != 0 for rc in result.returncodes), result.returncodes  # nobody "finished" the collective
    assert not result.ok
    assert result.detect_seconds is not None and 0 <= result.detect_seconds < 30
    assert result.detect_seconds <= result.seconds


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_kills_the_rank_named_by_the_trigger(tmp_path: Path) -> None:
    trigger = tmp_path / "trigger"
    result = launch(WORKER, ["hang", str(trigger), "10"], 2, env=ENV, kill=(1, trigger), log_dir=tmp_path / "logs")
    assert trigger.exists()
    assert result.failed_rank == 1 and result.returncodes[1] == -9, (result, _log_tail(tmp_path / "logs"))
    assert result.returncodes[0] != 0  # the survivor's collective failed, it did not hang
    assert result.seconds < 45


@pytest.mark.slow
@pytest.mark.distributed
def test_comm_counts_exact_payload_bytes_and_reduces(tmp_path: Path) -> None:
    world = 2
    result = launch(WORKER, ["count", str(tmp_path)], world, env=ENV, log_dir=tmp_path / "logs")
    assert result.ok and result.failed_rank is None and result.detect_seconds is None, _log_tail(tmp_path / "logs")
    expected = {}
    for name, dtype, shape in COUNT_TENSORS:
        t = torch.empty(shape, dtype=dtype)
        expected[name] = t.numel() * t.element_size()
    assert expected["bf16"] == 18 and expected["f64"] == 56 and expected["u8"] == 11  # element sizes 2, 8, 1
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sent_bytes"] == sum(expected.values())
        assert got["per_op"] == expected
        assert got["calls"] == len(COUNT_TENSORS)
        assert got["seconds"] > 0
        # Every element is the sum over ranks of (rank + 1): the collective really ran.
        assert all(values == [float(sum(range(1, world + 1)))] for values in got["reduced"].values()), got


def test_comm_on_one_rank_sends_nothing() -> None:
    from runners.distributed import Comm

    comm = Comm(1)
    t = torch.arange(6, dtype=torch.float32)
    comm.all_reduce_sum(t, "gradient")
    assert comm.sent_bytes == 0 and comm.calls == 0 and comm.per_op == {}
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # world 1: the sum over ranks is the tensor itself


def test_interface_counters_parse_proc_net_dev() -> None:
    if not Path("/proc/net/dev").exists():
        pytest.skip("no /proc/net/dev on this platform")
    before = interface_counters()
    assert "lo" in before
    for counts in before.values():
        assert set(counts) == {"rx", "tx"} and all(isinstance(v, int) and v >= 0 for v in counts.values())
    # Push a known number of bytes through loopback: lo's counters must grow by at least that much.
    payload = b"x" * 200_000
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            conn, _ = server.accept()
            with conn:
                client.sendall(payload)
                got = 0
                while got < len(payload):
                    got += len(conn.recv(65536))
    delta = counter_delta(before, interface_counters())
    # Bytes (columns 0 and 8), not packets: a few dozen loopback packets carry these 200,000 bytes.
    assert delta["lo"]["tx"] >= len(payload) and delta["lo"]["rx"] >= len(payload)
    names = [line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]]
    assert sorted(names) == sorted(interface_counters())


def test_counter_delta_covers_new_interfaces() -> None:
    before = {"lo": {"rx": 10, "tx": 20}}
    after = {"lo": {"rx": 15, "tx": 50}, "eth0": {"rx": 7, "tx": 9}}
    assert counter_delta(before, after) == {"eth0": {"rx": 7, "tx": 9}, "lo": {"rx": 5, "tx": 30}}


def test_rank_env_reads_what_torchrun_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                 "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    assert RankEnv.from_environ() == RankEnv(rank=5, world=8, local_rank=1, master_addr="10.0.0.2", master_port=29999)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k)
    assert RankEnv.from_environ() == RankEnv(0, 1, 0, "127.0.0.1", 29500)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
