"""Factories that return the wrong thing, raise, or take arguments xirang does not pass; and
--batch/--seq given to a factory that would ignore them. Each is refused naming the factory and
what it must return; what is fine (a model alone) works."""
from __future__ import annotations

import pytest

from tests.bad_input.probe import MODELS, assert_clear_cli, assert_clear_error, cli
from xirang.ir.errors import XirangError
from xirang.cli.model_files import build, load_factory

BAD = [  # (factory, words of the refusal)
    ("three_tuple", "tuple of 3 items"),
    ("returns_none", "returned a NoneType"),
    ("returns_dict", "returned a dict"),
    ("kwargs_as_list", "must be a dict"),
    ("inputs_first", "first item is not a torch.nn.Module"),
    ("raises", "the dataset folder /data/cifar is missing"),
    ("needs_path", "needs the argument(s) ['path']"),
    ("NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
]


@pytest.mark.parametrize("factory,needle", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("command", ["analyze", "plan", "verify"])
def test_bad_factory_is_refused_with_what_it_must_return(factory, needle, command):
    argv = {"analyze": ["analyze"], "plan": ["plan", "--global-batch", "8", "--world", "1", "--hardware", "cpu"],
            "verify": ["verify", "--world", "1"]}[command]
    assert_clear_cli(cli(argv[0], f"{MODELS}:{factory}", *argv[1:]), needle)


@pytest.mark.parametrize("factory,needle", BAD[:-1], ids=[b[0] for b in BAD[:-1]])
def test_build_api_refuses_the_same(factory, needle):
    with pytest.raises(XirangError) as info:
        build(load_factory(f"{MODELS}:{factory}"), None, None)
    assert_clear_error(info.value, needle)


def test_factory_error_names_the_line_that_raised():
    err = assert_clear_cli(cli("analyze", f"{MODELS}:raises"), "RuntimeError")
    assert "models.py:" in err  # where: the factory's file and line


@pytest.mark.parametrize("option", ["--batch", "--seq"])
def test_size_option_the_factory_would_ignore_is_refused(option):
    assert_clear_cli(cli("analyze", f"{MODELS}:no_batch_parameter", option, "4"),
                     f"{option} 4", "does not take", "drop")


def test_seq_given_to_a_model_without_seq_is_refused():
    assert_clear_cli(cli("plan", f"{MODELS}:mlp", "--global-batch", "8", "--world", "1", "--seq", "16"),
                     "--seq 16", "does not take 'seq'")


def test_factory_returning_the_model_alone_is_accepted():
    model, inputs = build(load_factory(f"{MODELS}:model_only"), None, None)
    assert isinstance(model, __import__("torch").nn.Module) and inputs == {}


def test_factory_returning_model_and_inputs_is_accepted_with_the_batch_asked():
    model, inputs = build(load_factory(f"{MODELS}:mlp"), 5, None, strict=True)
    assert inputs["x"].shape == (5, 4)
