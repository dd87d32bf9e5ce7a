"""``gpu`` tests skip without CUDA, fail under QSA_REQUIRE_GPU=1, and run where CUDA is."""

from __future__ import annotations

import pytest
import torch

CONFTEST = 'pytest_plugins = ("qsa_pytest.gpu",)\n'  # as each package's conftest loads it
TESTS = """
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    import torch
    assert torch.cuda.is_available()

def test_anywhere():
    pass
"""


def _run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, cuda: bool, required: bool
) -> pytest.RunResult:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if required:
        monkeypatch.setenv("QSA_REQUIRE_GPU", "1")
    else:
        monkeypatch.delenv("QSA_REQUIRE_GPU", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_it=TESTS)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers", "-rs")


def test_without_cuda_a_gpu_test_is_skipped_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, cuda=False, required=False)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs a CUDA device (torch.cuda.is_available() is False)*"])


def test_without_cuda_but_required_a_gpu_test_fails_naming_the_switch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, cuda=False, required=True)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*QSA_REQUIRE_GPU=1 but torch.cuda.is_available() is False*"])


@pytest.mark.gpu
def test_with_cuda_a_gpu_test_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, cuda=True, required=True)
    result.assert_outcomes(passed=2)
