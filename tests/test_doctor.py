"""doctor's judgements of a host: the NVIDIA driver against CUDA 13, free disk for the images."""

from __future__ import annotations

import pytest

from servekit.machine.doctor import disk_finding, driver_finding


@pytest.mark.parametrize("version,status", [("580.159.04", "ok"), ("581.15", "ok"), ("575.64.05", "fail"),
                                            ("550.144.03", "fail"), ("garbage", "warn")])
def test_the_driver_is_judged_against_r580(version, status):
    found = driver_finding(version)
    assert found.status == status, found
    if status == "fail":
        assert "R580" in found.detail and "580 or newer" in found.fix and "WSL2" in found.fix


@pytest.mark.parametrize("free_gb,status", [(200, "ok"), (30, "ok"), (29, "warn"), (12, "warn"), (11, "fail"),
                                            (0, "fail")])
def test_free_disk_is_judged_against_the_images(free_gb, status):
    found = disk_finding(int(free_gb * 1e9), "/var/lib/docker")
    assert found.status == status and f"{free_gb} GB free" in found.detail and "/var/lib/docker" in found.detail
    assert (found.fix != "") == (status != "ok")
