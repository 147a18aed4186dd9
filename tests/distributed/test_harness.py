"""How ``@check`` registers checks, parameters included, and how the backend is chosen (no processes)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import harness
from tests.distributed.harness import BACKEND_ENV, CHECKS, check, names

SUITE = "harness_selftest"


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    for key in [k for k in CHECKS if k.startswith(SUITE + "@")]:
        del CHECKS[key]


def test_params_register_one_named_check_per_combination_and_pass_the_values():
    calls = []

    @check(SUITE, world_sizes=(2, 4), params={"strategy": ["no_shard", "optim"], "steps": [1, 3]})
    def trains(strategy: str, steps: int) -> None:
        calls.append((strategy, steps))

    @check(SUITE, world_sizes=(2,))
    def plain() -> None:
        calls.append("plain")

    expected = ["trains[strategy=no_shard,steps=1]", "trains[strategy=no_shard,steps=3]",
                "trains[strategy=optim,steps=1]", "trains[strategy=optim,steps=3]"]
    assert names(SUITE, 4) == expected
    assert names(SUITE, 2) == [*expected, "plain"]
    for _, fn in CHECKS[f"{SUITE}@2"]:
        fn()
    assert calls == [("no_shard", 1), ("no_shard", 3), ("optim", 1), ("optim", 3), "plain"]


def test_a_check_can_be_registered_twice_with_other_params_and_world_sizes():
    @check(SUITE, world_sizes=(2,), params={"optimizer": ["adamw_single"]})
    @check(SUITE, world_sizes=(2, 4), params={"optimizer": ["adamw_fused", "sgd"]})
    def parity(optimizer: str) -> None:
        pass

    both = ["parity[optimizer=adamw_fused]", "parity[optimizer=sgd]"]
    assert names(SUITE, 2) == [*both, "parity[optimizer=adamw_single]"]
    assert names(SUITE, 4) == both


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ({"strategy": []}, ValueError, "params['strategy'] must be a non-empty list of values"),
        ({"strategy": "optim"}, ValueError, "params['strategy'] must be a non-empty list of values"),
        ({"strategy": [None]}, TypeError, "values must be str, int, float or bool"),
        ({"stratgy": ["optim"]}, TypeError, "params ['stratgy'] do not fit its arguments"),
    ],
    ids=["no_values", "a_string", "a_none_value", "an_unknown_argument"],
)
def test_bad_params_are_refused_at_registration(params, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        @check(SUITE, params=params)
        def parity(strategy: str) -> None:
            pass
    assert names(SUITE, 2) == []


def test_two_checks_of_one_name_in_a_suite_are_refused():
    @check(SUITE, world_sizes=(2,))
    def bad_input_errors() -> None:
        pass

    with pytest.raises(ValueError, match="suite 'harness_selftest' already has a check named 'bad_input_errors'"):
        @check(SUITE, world_sizes=(2,))
        def bad_input_errors() -> None:  # noqa: F811 (the duplicate under test)
            pass


def test_the_backend_and_device_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert (harness.backend(), harness.device_type(), harness.device()) == ("gloo", "cpu", torch.device("cpu"))
    assert harness.skip_reason(4) is None  # gloo runs any world size on the CPU
    monkeypatch.setenv(BACKEND_ENV, "NCCL")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (harness.backend(), harness.device_type(), harness.device()) == ("nccl", "cuda", torch.device("cuda", 1))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for world_size in (1, 2, 4):
        reason = harness.skip_reason(world_size)
        if visible >= max(world_size, 2) and torch.distributed.is_nccl_available():
            assert reason is None
        else:  # skipped with the reason, never run on too few GPUs
            assert reason is not None and ("GPU" in reason or "CUDA" in reason), reason
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="MEGATRON_FSDP_TEST_BACKEND='mpi'.*gloo.*nccl"):
        harness.backend()
