"""Device profiles and the roofline estimate."""

import pytest
import torch

from gradshard.cost.devices import DEVICES, devices, get_device, roofline_seconds

GiB = 2**30


def test_required_profiles_exist_with_sane_numbers():
    assert {"h100", "h200", "a100", "rtx3090"} <= set(devices())
    expect_mem = {"h100": 80, "h200": 141, "a100": 80, "rtx3090": 24}
    for name, gib in expect_mem.items():
        d = get_device(name)
        assert d.memory_bytes == gib * GiB
        assert 0.5e12 < d.hbm_bandwidth < 10e12
        assert d.flops_per_second(torch.bfloat16) > d.flops_per_second(torch.float32) > 0
        for link in ("nvlink", "pcie", "ethernet", "infiniband"):
            assert d.link_bandwidth(link) > 0
    assert get_device("h200").hbm_bandwidth > get_device("h100").hbm_bandwidth > get_device("a100").hbm_bandwidth
    assert get_device("H100") is get_device("h100") and get_device("3090") is get_device("rtx3090")


def test_unknown_device_and_dtype_errors_name_the_choices():
    with pytest.raises(KeyError, match="h100"):
        get_device("tpu-v9")
    with pytest.raises(KeyError, match="bfloat16"):
        get_device("h100").flops_per_second("int4")


def test_roofline_picks_the_slower_bound_and_adds_communication():
    d = get_device("h100")
    compute = roofline_seconds(d, flops=989.4e12, hbm_bytes=0, dtype="bf16")
    assert compute.seconds == pytest.approx(1.0) and compute.bound == "compute"
    memory = roofline_seconds(d, flops=0, hbm_bytes=3.35e12, dtype=torch.bfloat16)
    assert memory.seconds == pytest.approx(1.0) and memory.bound == "memory"
    comm = roofline_seconds(d, flops=0, hbm_bytes=0, comm_bytes=450e9, link="nvlink")
    assert comm.seconds == pytest.approx(1.0) and comm.comm_seconds == pytest.approx(1.0)
    assert "roofline estimate" in comm.label
    assert set(DEVICES) >= {"h100", "h200", "a100", "rtx3090"}
