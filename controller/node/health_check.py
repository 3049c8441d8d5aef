"""The node's deterministic health check: every tile must reproduce a fixed-seed matmul.

The agent runs it when it registers, before every generation its node takes part in, and on
demand (`optimus health-check`). A tile that fails names itself `<node>/<index>`, and the
controller excludes the node ("bad tile ..."). A check that passes says when (`ok_at`): the
agent keeps that time through later failures, and the controller trusts no checkpoint committed
after it once the node is found computing wrong.
"""

from __future__ import annotations

import os
import time

# The fixed-seed matmul's checksum, computed once on the CPU in float64: every tile must
# reproduce it (to 1e-6 relative: devices sum in other orders) and agree with itself bit for bit.
_CHECK_SEED, _CHECK_SIZE = 1234, 256


def health_check(node: str, corrupt: set[int] = frozenset()) -> dict:
    """Devices, and the deterministic compute check on every tile (tile ids: `<node>/<index>`;
    a CPU node is one tile, index 0). `corrupt`: tiles made to compute wrong (fault injection)."""
    try:
        import torch  # here, not at import: the agent's loop needs no torch

        devices, kind = 0, "cpu"
        if torch.cuda.is_available():
            devices, kind = torch.cuda.device_count(), "cuda"
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            devices, kind = torch.xpu.device_count(), "xpu"
        g = torch.Generator().manual_seed(_CHECK_SEED)
        a = torch.randn(_CHECK_SIZE, _CHECK_SIZE, generator=g, dtype=torch.float64)
        reference = (a @ a).sum().item()
        for index in range(max(devices, 1)):
            device = torch.device(kind, index) if devices else torch.device("cpu")
            x = a.to(device)
            if index in corrupt:
                x = x + 1e-3  # a tile whose arithmetic has gone wrong
            first, second = (x @ x).sum().item(), (x @ x).sum().item()
            if first != second or abs(first - reference) > 1e-6 * abs(reference):
                return {"devices": devices, "health": "bad",
                        "health_detail": f"{node}/{index}: fixed-seed matmul gave {first!r} "
                                         f"then {second!r}, reference {reference!r}"}
        return {"devices": devices or os.cpu_count(), "device_kind": kind, "health": "ok",
                "health_detail": "", "ok_at": time.time()}
    except Exception as e:  # a broken driver is a bad node, not a crashed agent
        return {"devices": 0, "health": "bad", "health_detail": f"{node}/?: "
                                                              f"{type(e).__name__}: {e}"}
