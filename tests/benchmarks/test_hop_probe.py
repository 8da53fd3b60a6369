"""benchmarks/hop_probe.py's kernel: compiles for sm_90 as the probe launches it (PDL on, each
kind of work), with the trigger before the wait and the ticket an acq_rel atomic; and under the
interpreter each launch reads the previous one's values and the last program's merge resets
the ticket."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.sm90 import compile_sm90, cuda_backend_available
from tests.helpers.tools import needs

pytest.importorskip("triton")


@needs(cuda_backend_available(), "triton without its CUDA backend (ptxas)")
@pytest.mark.timeout(300)
def test_hop_kernel_compiles_for_sm90_as_launched() -> None:
    from benchmarks.hop_probe import _hop_kernel

    types = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "ticket_ptr": "*i32", "merged_at": "i32"}
    for read, ticket in itertools.product((False, True), (False, True)):
        consts = {"PDL": True, "READ": read, "TICKET": ticket, "BLOCK": 64}
        ptx = compile_sm90(_hop_kernel, types, consts, 4, 1, divisible=()).asm["ptx"]
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
        assert ("gpu.acq_rel.add" in ptx) == ticket


def test_hop_kernel_chain_in_the_interpreter() -> None:
    code = textwrap.dedent("""
        import torch
        from benchmarks import hop_probe as hp
        a, b = torch.zeros(hp.MAX_PROGRAMS + 1), torch.zeros(hp.MAX_PROGRAMS + 1)
        tickets = torch.zeros(1, dtype=torch.int32)
        for i in range(3):  # a -> b -> a -> b: each launch adds one to what the last wrote
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            hp._hop_kernel[(5,)](src, dst, tickets, hp.MAX_PROGRAMS, PDL=False, READ=True,
                                 TICKET=True, BLOCK=8)
        assert b[:5].tolist() == [3.0] * 5 and b[5] == 0, b[:6]
        assert float(b[hp.MAX_PROGRAMS]) == 15.0  # the last program's merge of the five
        assert int(tickets) == 0
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
