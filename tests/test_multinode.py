"""Two machines, one training: two `accelerate launch --num_machines 2 --machine_rank {0,1}` launchers, one per
"machine", rendezvous over TCP at machine 0's address and train as one 2-rank group, with the same per-step
losses as 2 processes on one machine (configs/accelerate/2node.yaml, as the README tells users to launch it).

The machines are the launchers in two network namespaces joined by a veth pair, so that the group can only form
over a network link between "hosts" (needs the rights to create namespaces: root); where namespaces cannot be
created, the same launchers on one host over loopback. One launch either way: the second would prove nothing the
first does not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
from conftest import ACCEL_CONFIGS, BIN, REPO, free_port, read_metrics
from safetensors.torch import load_file
from test_topology import TOPOLOGIES, overrides

# The session's topology runs (conftest.runs) are computed once per test worker: these modules share one.
pytestmark = pytest.mark.xdist_group("ddp_reference")

TIMEOUT_S = 240  # a hang guard, not a speed bound: a passing run takes 10-20 s on 2 idle cores, over 60 s beside other runs


def launch_two_machines(tmp_path, args, address: str, namespaces=(None, None), env=None) -> list[str]:
    """Start machine 0 and machine 1 as users do; wait for both; return their logs. If one fails, the other
    is stopped at once: a machine left alone would wait for its peer until the rendezvous timeout."""
    port, procs, logs = free_port(), [], []
    for rank, ns in enumerate(namespaces):
        cmd = [BIN / "accelerate", "launch", "--config_file", ACCEL_CONFIGS / "2node.yaml", "--num_processes", "2",
               "--machine_rank", str(rank), "--main_process_ip", address, "--main_process_port", str(port),
               "accel_train/train.py", *args]
        if ns:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        log = tmp_path / f"machine{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**os.environ, **(env or {})},
                                      stdout=log.open("w"), stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            assert time.monotonic() < deadline, f"the two machines did not finish in {TIMEOUT_S} s"
            time.sleep(0.2)  # polling two children for the first to end; not a synchronisation
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # SIGTERM: the launcher stops its training processes (SIGKILL would orphan them)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    for rank, (p, text) in enumerate(zip(procs, texts)):
        print(f"--- machine {rank} (exit {p.returncode})\n{text[-6000:]}")
    assert [p.returncode for p in procs] == [0, 0], "a machine failed (logs above)"
    return texts


def check_same_as_one_machine(out, reference, logs):
    assert "2 process(es) on cpu" in logs[0], "machine 0 holds rank 0, which logs"
    assert " | loss " not in logs[1], "machine 1 holds rank 1 only, which logs nothing"
    got, want = read_metrics(out)[0], reference["train"]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"step {a['step']}"
    mine, ref = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (out, reference["out"]))
    assert mine.keys() == ref.keys()
    for key in ref:
        assert (mine[key] - ref[key]).norm() <= 1e-5 * ref[key].norm(), key


@pytest.fixture
def two_hosts():
    """(namespaces, machine 0's address, environment): two network namespaces, each with one end of a veth pair
    named `veth8` (as two hosts each have an eth0) and an address in 10.213.8.0/24, removed afterwards; where
    namespaces cannot be created, no namespaces and loopback (said in the test's output)."""
    names = [f"at8-{uuid.uuid4().hex[:8]}-{i}" for i in (0, 1)]
    made = subprocess.run(["ip", "netns", "add", names[0]], capture_output=True, text=True) if shutil.which("ip") else None
    if made is None or made.returncode != 0:
        print(f"cannot create network namespaces here ({made.stderr.strip() if made else 'no ip command'}): "
              "the two machines run over loopback")
        yield (None, None), "127.0.0.1", {}
        return
    try:
        for cmd in (["ip", "netns", "add", names[1]],
                    ["ip", "link", "add", "veth8", "netns", names[0], "type", "veth", "peer", "veth8", "netns", names[1]],
                    *(step for i, ns in enumerate(names) for step in (
                        ["ip", "-n", ns, "addr", "add", f"10.213.8.{i + 1}/24", "dev", "veth8"],
                        ["ip", "-n", ns, "link", "set", "veth8", "up"],
                        ["ip", "-n", ns, "link", "set", "lo", "up"]))):
            subprocess.run(cmd, check=True, capture_output=True)
        yield names, "10.213.8.1", {"GLOO_SOCKET_IFNAME": "veth8"}
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth pair along


@pytest.mark.long
def test_two_machines(tmp_path, ddp_reference, two_hosts):
    namespaces, address, env = two_hosts
    out = tmp_path / "run"
    args = overrides(ddp_reference["data"], out) + TOPOLOGIES["C"][1]
    # In the namespaces gloo picks its interface from the host name, which resolves to nothing there
    # (GLOO_SOCKET_IFNAME); on real machines with several networks the same variable chooses the one the ranks
    # share (README).
    logs = launch_two_machines(tmp_path, args, address, namespaces, env=env)
    check_same_as_one_machine(out, ddp_reference, logs)
