"""INT8-row tables: the quantizer's error bound, and the row gather against its torch reference."""

from __future__ import annotations

import pytest
import torch

from qsa_kernels import KernelInputError
from qsa_kernels.int8_rows import (
    Int8RowTable,
    dequantize_int8_rows_reference,
    gather_int8_rows,
    gather_int8_rows_reference,
    quantize_int8_rows,
)

#: Qwen3.8-Flash-Next's PLE rows: 160 values (a head's share of a 2,560-wide embedding).
ROW = 160


def _table(rows: int, dim: int = ROW, *, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(
        torch.bfloat16
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantized_values_are_within_half_a_step_of_their_source(dtype: torch.dtype) -> None:
    source = _table(64).to(dtype)
    table = quantize_int8_rows(source)
    assert table.values.dtype is torch.int8
    assert table.scales.dtype is torch.float32
    want_scale = source.float().abs().amax(dim=1) / 127
    assert torch.equal(table.scales, want_scale)
    error = (table.values.float() * table.scales[:, None] - source.float()).abs()
    float32_rounding = 4 * torch.finfo(torch.float32).eps * source.float().abs()
    assert bool((error <= table.scales[:, None] / 2 + float32_rounding).all())
    # The largest element of every row is stored at full scale.
    assert bool((table.values.abs().amax(dim=1) == 127).all())


def test_a_row_of_zeros_has_scale_zero_and_dequantizes_to_zeros() -> None:
    source = _table(4)
    source[2] = 0
    table = quantize_int8_rows(source)
    assert table.scales[2].item() == 0.0
    assert not table.values[2].any()
    assert not dequantize_int8_rows_reference(table)[2].any()


def test_a_table_with_a_non_finite_value_is_refused() -> None:
    source = _table(3)
    source[1, 5] = float("inf")
    with pytest.raises(KernelInputError, match="non-finite"):
        quantize_int8_rows(source)


def test_a_table_whose_scales_and_values_disagree_is_refused() -> None:
    table = quantize_int8_rows(_table(8))
    with pytest.raises(KernelInputError, match="scales has 7 rows; values has 8"):
        Int8RowTable(table.values, table.scales[:7].contiguous())
    with pytest.raises(KernelInputError, match="values"):
        Int8RowTable(table.values.float(), table.scales)


def test_reference_gathers_the_shard_rows_and_zeros_for_other_ranks_ids() -> None:
    table = quantize_int8_rows(_table(10))
    dense = dequantize_int8_rows_reference(table)
    ids = torch.tensor([[100, 109, 99], [110, 104, 100]])  # the shard holds ids [100, 110)
    got = gather_int8_rows_reference(table, ids, vocab_start=100, vocab_end=110)
    assert got.shape == (2, 3, ROW)
    assert got.dtype is torch.bfloat16
    assert torch.equal(got[0, 0], dense[0])
    assert torch.equal(got[0, 1], dense[9])
    assert torch.equal(got[1, 1], dense[4])
    assert not got[0, 2].any()  # below the shard
    assert not got[1, 0].any()  # past it


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dim", [ROW, 64, 7])
def test_kernel_rows_equal_the_reference_bit_for_bit(
    kernel_device: str, id_dtype: torch.dtype, dim: int
) -> None:
    dev = torch.device(kernel_device)
    table = quantize_int8_rows(_table(300, dim, seed=dim))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-5, 340, (4, 37), generator=g, dtype=id_dtype)  # some outside [20, 320)
    want = gather_int8_rows_reference(table, ids, vocab_start=20, vocab_end=320)
    on_device = Int8RowTable(table.values.to(dev), table.scales.to(dev))
    out = torch.full((4, 37, dim), float("nan"), dtype=torch.bfloat16, device=dev)
    got = gather_int8_rows(on_device, ids.to(dev), vocab_start=20, vocab_end=320, out=out)
    assert got is out
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_kernel_reads_a_pinned_host_table_in_place() -> None:
    table = quantize_int8_rows(_table(1000, seed=3)).pin()
    ids = torch.randint(0, 1000, (513,), generator=torch.Generator().manual_seed(4))
    got = gather_int8_rows(table, ids.cuda())
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), gather_int8_rows_reference(table, ids))


def test_an_empty_id_list_gathers_nothing(kernel_device: str) -> None:
    table = quantize_int8_rows(_table(5))
    dev = torch.device(kernel_device)
    on_device = Int8RowTable(table.values.to(dev), table.scales.to(dev))
    got = gather_int8_rows(on_device, torch.empty(0, 3, dtype=torch.int64, device=dev))
    assert got.shape == (0, 3, ROW)


def test_gathers_refuse_a_bad_shard_ids_or_output(kernel_device: str) -> None:
    dev = torch.device(kernel_device)
    table = quantize_int8_rows(_table(5))
    table = Int8RowTable(table.values.to(dev), table.scales.to(dev))
    ids = torch.zeros(3, dtype=torch.int64, device=dev)
    with pytest.raises(KernelInputError, match=r"the shard \[0, 6\) must hold 1 to 5 rows"):
        gather_int8_rows(table, ids, vocab_end=6)
    with pytest.raises(KernelInputError, match="ids"):
        gather_int8_rows(table, ids.float())
    bad = torch.empty(3, ROW, dtype=torch.float32, device=dev)
    with pytest.raises(KernelInputError, match=r"out is \(3, 160\) torch.float32"):
        gather_int8_rows(table, ids, out=bad)
    with pytest.raises(KernelInputError, match="vocab_start=-1"):
        gather_int8_rows_reference(table, ids, vocab_start=-1)


def test_kernel_rounds_ties_to_even_as_torch_does(kernel_device: str) -> None:
    """Rows exactly halfway between two bf16 values round to the even one, on every path."""
    halfway = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000], dtype=torch.int64)
    scales = halfway.to(torch.int32).view(torch.float32)  # 1 + 2^-8, 1 + 3 * 2^-8, -(1 + 2^-8)
    dev = torch.device(kernel_device)
    table = Int8RowTable(torch.ones(3, 4, dtype=torch.int8, device=dev), scales.to(dev))
    got = gather_int8_rows(table, torch.arange(3, device=dev)).cpu()
    assert got[:, 0].tolist() == [1.0, 1.015625, -1.0]
    assert torch.equal(got, gather_int8_rows_reference(table, torch.arange(3, device=dev)).cpu())
