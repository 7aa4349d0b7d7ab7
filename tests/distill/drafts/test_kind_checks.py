"""The checks every kind shares: its options (``draft.options`` and ``--draft-option``) by name and
type, and the draft settings a kind does not take."""

import pytest

from draftsmith.distill.drafts import kind_named
from draftsmith.distill.drafts.kind import DraftSettings, check_options, refuse_settings
from draftsmith.specdec.errors import DraftsmithError


def test_an_unknown_option_is_named_with_the_known_ones_and_the_nearest():
    with pytest.raises(DraftsmithError) as err:
        check_options("parallel", {"cod_rate": 0.5}, {"cod_ratio": float, "k": int}, "draft.options:", "an option")
    assert str(err.value) == (
        "draft.options: 'cod_rate' is not an option of parallel drafts (known: cod_ratio, k); did you mean 'cod_ratio'?"
    )


def test_a_value_of_another_type_is_refused_and_a_bool_is_not_an_int():
    known = {"k": int, "decay": float}
    check_options("dflash", {"k": 3, "decay": 2.0}, known, "draft.options:", "an option")
    with pytest.raises(DraftsmithError, match=r"^draft.options: k must be a int, got True$"):
        check_options("dflash", {"k": True}, known, "draft.options:", "an option")
    with pytest.raises(DraftsmithError, match=r"^draft.options: decay must be a float, got '2'$"):
        check_options("dflash", {"decay": "2"}, known, "draft.options:", "an option")


def test_decode_options_are_checked_the_same_way_under_their_flag():
    early_exit = kind_named("early_exit")
    early_exit.check_decode_options({"kv_reuse": False})
    with pytest.raises(DraftsmithError) as err:
        early_exit.check_decode_options({"kv_reus": False})
    assert str(err.value) == (
        "--draft-option 'kv_reus' is not a decode option of early_exit drafts (known: kv_reuse); "
        "did you mean 'kv_reuse'?"
    )
    with pytest.raises(DraftsmithError, match=r"^--draft-option kv_reuse must be a bool, got 3$"):
        early_exit.check_decode_options({"kv_reuse": 3})
    with pytest.raises(DraftsmithError, match=r"is not a decode option of lm drafts \(known: none\)$"):
        kind_named("lm").check_decode_options({"kv_reuse": False})


def test_the_first_setting_given_of_those_refused_is_named():
    refused = ("draft.lora_r", "draft.vocab", "draft.config", "draft.model")
    refuse_settings("early_exit", DraftSettings(layers="1"), refused, "share the target's head")  # all left out
    given = DraftSettings(model="some/model", train_draft_vocab=100)
    with pytest.raises(DraftsmithError, match=r"^early_exit drafts share the target's head: leave out draft.vocab$"):
        refuse_settings("early_exit", given, refused, "share the target's head")
    with pytest.raises(DraftsmithError, match=r"leave out draft.model$"):
        refuse_settings("early_exit", given, ("draft.model", "draft.vocab"), "share the target's head")


@pytest.mark.parametrize(
    ("kind", "settings", "message"),
    [
        ("early_exit", {"lora_r": 4}, "early_exit drafts share the target's head and layers: leave out draft.lora_r"),
        ("dflash", {"config": {"hidden_size": 8}}, "dflash drafts are decoder layers on the target's head: leave out"),
        ("eagle3", {"model": "x"}, "eagle3 drafts are one decoder layer built on the target: leave out draft.model"),
        ("parallel", {"lora_r": 8}, "parallel drafts train the whole draft: leave out draft.lora_r"),
    ],
)
def test_each_kind_refuses_what_it_does_not_take(kind, settings, message):
    options = {"mask_token_id": 5} if kind in ("dflash", "parallel") else {}
    with pytest.raises(DraftsmithError, match=message):
        kind_named(kind).check(DraftSettings(kind=kind, layers="1", options=options, **settings))
