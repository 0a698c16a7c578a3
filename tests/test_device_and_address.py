"""Pure selection logic with no GPU and no second node: the device each rank computes on, and the address a
cross-node pipeline rendezvous listens on; one launch for a device no rank can use."""

from __future__ import annotations

import pytest

from mpitp.errors import UsageError
from mpitp.parallel.device import DevicePlan, plan_device


@pytest.mark.parametrize("requested", [None, "cuda"])
def test_one_gpu_per_task(requested):
    """SLURM --gpus-per-task=1 (or a per-rank CUDA_VISIBLE_DEVICES): each rank sees one GPU, numbered 0, whatever
    its local rank (was cuda:{local_rank} for --device cuda: "invalid device ordinal" on every rank but the first)."""
    for local_rank in range(4):
        assert plan_device(requested, local_rank, visible=1) == DevicePlan("cuda:0", set_device=True, hide_gpus=False)


@pytest.mark.parametrize("requested", [None, "cuda", "CUDA"])
def test_several_gpus_per_node(requested):
    """4 GPUs visible (CUDA_VISIBLE_DEVICES unset, or set to the node's 4): rank r -> cuda:r; 8 ranks share them
    round robin."""
    assert [plan_device(requested, r, 4).device for r in range(8)] == [f"cuda:{r % 4}" for r in range(8)]
    assert all(plan_device(requested, r, 4).set_device for r in range(8))  # dp-only ranks too (was tp > 1 only)


def test_cuda_visible_devices_subset():
    """CUDA_VISIBLE_DEVICES=2,3 on a 4-GPU node: torch sees 2, indices 0 and 1 (never the physical 2, 3)."""
    assert [plan_device("cuda", r, 2).device for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert plan_device("cuda:1", 0, 2).device == "cuda:1"
    with pytest.raises(UsageError, match=r"--device cuda:2: this process sees 2 CUDA device\(s\) \(indices 0..1"):
        plan_device("cuda:2", 0, 2)


def test_no_gpu():
    assert plan_device(None, 3, 0) == DevicePlan("cpu", set_device=False, hide_gpus=False)
    with pytest.raises(UsageError, match="--device cuda: no CUDA device is visible"):
        plan_device("cuda", 0, 0)
    with pytest.raises(UsageError, match="no CUDA device is visible"):
        plan_device("cuda:0", 0, 0)
    with pytest.raises(UsageError, match="expected cpu, cuda or cuda:<index>"):
        plan_device("gpu", 0, 1)


def test_cpu_on_a_gpu_node_hides_the_gpus():
    """--device cpu on a GPU node: the GPUs are hidden (not even counted) so that transformers' sharded loading,
    which picks the accelerator itself, cannot put tp/pp shards on cuda:r while the engine feeds CPU tensors."""
    for visible in (None, 0, 4):
        assert plan_device("cpu", 2, visible) == DevicePlan("cpu", set_device=False, hide_gpus=True)


def test_runtime_hides_gpus_for_cpu(monkeypatch):
    """The runtime applies the plan: CUDA_VISIBLE_DEVICES="" before anything starts CUDA, and no device count."""
    import torch

    from mpitp.parallel import runtime
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("GPUs counted for --device cpu"))
    plan = runtime._device_plan("cpu", 1)
    assert plan.device == "cpu"
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


# ------------------------------------------------------------------------------------ cross-node rendezvous address

from mpitp.parallel.netaddr import choose_address, interface_addresses  # noqa: E402

NODE = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.1.2.3"], "ib0": ["192.168.10.3"]}


def test_debian_hosts_loopback_is_never_chosen():
    """/etc/hosts maps the host name to 127.0.1.1 (Debian): the first physical interface's address instead (was
    127.0.1.1: the other node waited until --timeout)."""
    assert choose_address(NODE, ["127.0.1.1"], {}) == "10.1.2.3"
    assert choose_address({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "enp1s0": ["10.0.0.7"]}, [], {}) == \
        "10.0.0.7"


def test_resolvable_host_name_wins_over_interfaces():
    assert choose_address(NODE, ["127.0.1.1", "192.168.10.3"], {}) == "192.168.10.3"


def test_overrides():
    assert choose_address(NODE, ["127.0.1.1"], {"MPITP_STORE_ADDR": "10.9.9.9"}) == "10.9.9.9"
    assert choose_address(NODE, ["10.1.2.3"], {"GLOO_SOCKET_IFNAME": "ib0"}) == "192.168.10.3"
    assert choose_address(NODE, [], {"NCCL_SOCKET_IFNAME": "=ib"}) == "192.168.10.3"  # NCCL's prefix syntax
    assert choose_address(NODE, ["127.0.1.1"], {"NCCL_SOCKET_IFNAME": "^docker"}) == "10.1.2.3"  # exclusion: ignored
    assert choose_address(NODE, ["127.0.1.1"], {"GLOO_SOCKET_IFNAME": "missing0"}) == "10.1.2.3"
    # MPITP_IFACE, the one setting mpitp documents, before the libraries' own variables
    assert choose_address(NODE, ["10.1.2.3"], {"MPITP_IFACE": "ib", "GLOO_SOCKET_IFNAME": "eth"}) == "192.168.10.3"


def test_an_iface_the_node_lacks_is_refused_not_passed_over():
    """MPITP_IFACE=ib1 on a node with ib0 only: the host name's address was taken instead, in silence (another
    network, or one the nodes cannot reach each other on). NCCL's prefix match holds, as in choose_address."""
    from mpitp.parallel.netaddr import iface_objection

    assert iface_objection({"MPITP_IFACE": "ib1"}, "n7", NODE) == (
        "--iface ib1 (MPITP_IFACE): node n7 has no interface of that name with a non-loopback IPv4 address (it has "
        "docker0 172.17.0.1, eth0 10.1.2.3, ib0 192.168.10.3, lo 127.0.0.1)")
    assert "node n7 has no interface" in iface_objection({"MPITP_IFACE": "lo"}, "n7", NODE)  # loopback only
    for env in ({"MPITP_IFACE": "ib"}, {"MPITP_IFACE": "ib0"}, {"MPITP_IFACE": "ib9,eth0"}, {}, {"MPITP_IFACE": ""},
                {"GLOO_SOCKET_IFNAME": "missing0"}):  # the libraries' own variables: theirs to refuse
        assert iface_objection(env, "n7", NODE) is None, env
    assert iface_objection({"MPITP_IFACE": "ib0"}, "n7", {}) is None  # interfaces not listed here: not checked


def test_link_local_and_loopback_only_is_an_error():
    with pytest.raises(RuntimeError, match="set MPITP_IFACE"):
        choose_address({"lo": ["127.0.0.1"], "eth0": ["169.254.3.4"], "docker0": ["172.17.0.1"]}, ["127.0.1.1"], {})


def test_interface_addresses_of_this_host():
    """The real enumeration (SIOCGIFADDR) finds the loopback at least, as IPv4 text."""
    found = interface_addresses()
    assert found.get("lo") == ["127.0.0.1"], found


@pytest.mark.mpi
def test_a_device_no_rank_can_use_is_refused_in_one_line(tmp_path):
    """``--device cuda`` where no rank sees a GPU: each rank refused on its own and aborted, so the line came once per
    rank (before the abort reached the others); now the ranks agree on the first refusal and rank 0 prints it."""
    import torch

    from support.mpi import explain, run_mpi

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_mpi(2, ["eval", "--demo", "--tp", "2", "--device", "cuda", "--output", str(tmp_path / "d.h5")],
                   timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines() == [
        "mpitp: error: --device cuda: no CUDA device is visible to this process (torch sees 0; check "
        "CUDA_VISIBLE_DEVICES and the CUDA build of torch)"], explain(proc)
