"""Committed wire frames: what a peer running an older release sends must keep decoding.

The v1 hex below was written by the v1 encoder (before codec v2 added int8 values).  A v1
frame must decode to the same content, and a frame without int8 tensors must still be
written as exactly these bytes, so older devices can read what a newer aggregator sends.
The v2 hex pins the int8 layout and the stochastic rounding stream (seed derivation).
"""

from __future__ import annotations

import numpy as np
import pytest

from fclcore.codec import Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode


def golden_content() -> Frame:
    """Dense, index-list, bitmap and scalar tensors in one frame."""
    few = np.zeros(40, np.float32)
    few[[3, 31]] = [1.5, -2.0]
    many = np.zeros(16, np.float32)
    many[:10] = np.arange(1, 11) / 4
    return Frame(
        Header(Kind.UPDATE, "fed", 3, 1, "client-1", 7),
        {"lr": 0.5, "n": 5},
        {
            "w": np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5,
            "few": SparseTensor.from_dense(few),
            "many": SparseTensor.from_dense(many),
            "s": np.array(-0.25, np.float32),
        },
    )


V1_FRAMES = {
    "float32": (
        "46434c5701020000030000000100000007000000000000000366656408636c69656e742d31100000007b226c72223a302e352c"
        "226e223a357d040001770001020200000003000000000020c00000c0bf000000bf0000003f0000c03f00002040036665770101"
        "01280000000200000003001f000000c03f000000c0046d616e79020101100000000a000000ff030000803e0000003f0000403f"
        "0000803f0000a03f0000c03f0000e03f0000004000001040000020400173000100000080bee1e27296"
    ),
    "float16": (
        "46434c5701020000030000000100000007000000000000000366656408636c69656e742d31100000007b226c72223a302e352c"
        "226e223a357d04000177000202020000000300000000c100be00b80038003e004103666577010201280000000200000003001f"
        "00003e00c0046d616e79020201100000000a000000ff0300340038003a003c003d003e003f004080400041017300020000b4f7"
        "e0cb71"
    ),
}


@pytest.mark.parametrize("value_dtype", list(V1_FRAMES))
def test_v1_frame_decodes(value_dtype):
    data = bytes.fromhex(V1_FRAMES[value_dtype])
    assert data[4] == 1  # the version byte
    got, want = decode(data), golden_content()
    assert got.header == want.header and got.meta == want.meta and list(got.tensors) == list(want.tensors)
    for name, sent in want.tensors.items():
        assert isinstance(got.tensors[name], type(sent))  # a decoded SparseTensor may be a PackedSparse
        if isinstance(sent, SparseTensor):
            assert got.tensors[name] == sent  # all values here are exact in float16
        else:
            np.testing.assert_array_equal(got.tensors[name], sent)


@pytest.mark.parametrize("value_dtype", list(V1_FRAMES))
def test_frame_without_int8_is_written_as_v1(value_dtype):
    assert encode(golden_content(), value_dtype).hex() == V1_FRAMES[value_dtype]


V2_FRAMES = {
    ValueCoding("int8", block=4): (
        "46434c5702020000030000000100000007000000000000000366656408636c69656e742d31100000007b226c72223a302e352c"
        "226e223a357d04000177000302020000000300000004008642a13c8642a13c81b4e7194c7f03666577010301280000000200"
        "000003001f0004000502813c5f81046d616e79020301100000000a000000ff0304000502013c0502813c8642a13c203f5f7f"
        "4f5f6f7f727f017300030004000502013b81414ea5d0"
    ),
    ValueCoding("int8", block=4, rounding="stochastic", seed=3): (
        "46434c5702020000030000000100000007000000000000000366656408636c69656e742d31100000007b226c72223a302e352c"
        "226e223a357d04000177000302020000000300000004008642a13c8642a13c81b4e71a4c7f03666577010301280000000200"
        "000003001f0004000502813c5f81046d616e79020301100000000a000000ff0304000502013c0502813c8642a13c203f607f"
        "4f606f7f737f017300030004000502013b813b5d7bda"
    ),
}


@pytest.mark.parametrize("coding", list(V2_FRAMES), ids=lambda c: c.rounding)
def test_v2_int8_frame_is_stable(coding):
    data = bytes.fromhex(V2_FRAMES[coding])
    assert data[4] == 2 and encode(golden_content(), coding) == data
    got, want = decode(data), golden_content()
    for name, sent in want.tensors.items():
        sent = sent.to_dense() if isinstance(sent, SparseTensor) else sent
        back = got.tensors[name]
        back = back.to_dense() if isinstance(back, SparseTensor) else back
        np.testing.assert_allclose(back, sent, atol=2.5 / 127)  # s = max|block| / 127 <= 2.5 / 127
