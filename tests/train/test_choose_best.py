"""eval-run's best checkpoint: a later draft wins only when its lead exceeds the spread over repeats."""

from draftsmith.train.speedup import card_figures, choose_best, choose_tree, chosen_figures, does_not_pay


def result(step, speedup, low, high):
    return {"step": step, "speedup": speedup, "speedup_spread": {"median": speedup, "min": low, "max": high}}


def test_a_lead_inside_the_spread_keeps_the_earlier_draft():
    candidates = {
        "initial": result(0, 0.90, 0.85, 0.95),
        "checkpoint-2": result(2, 1.30, 1.10, 1.60),
        "checkpoint-4": result(4, 1.45, 1.20, 1.70),  # highest median, but its min 1.20 < 1.60
    }
    best, note = choose_best(candidates)
    assert best == "checkpoint-2"
    assert note == (
        "checkpoint-4 measured the highest speedup (1.45) but within the spread over repeats of the "
        "earlier checkpoint-2 (1.30), so checkpoint-2 is kept"
    )


def test_a_clear_lead_wins_and_single_repeats_compare_their_values():
    clear = {"initial": result(0, 1.0, 0.9, 1.1), "checkpoint-2": result(2, 1.5, 1.2, 1.8)}
    assert choose_best(clear) == ("checkpoint-2", None)
    single = {"initial": {"step": 0, "speedup": 1.2}, "checkpoint-2": {"step": 2, "speedup": 1.1}}
    assert choose_best(single) == ("initial", None)


def test_a_tree_is_chosen_over_the_chain_only_when_it_measured_faster():
    assert choose_tree({"2": 1.10, "3,2,1": 1.35, "4": 1.30}, chain_speedup=1.20) == "3,2,1"
    assert choose_tree({"2": 1.10, "3,2,1": 1.35}, chain_speedup=1.40) is None
    assert choose_tree({"3,2,1": 1.35}, chain_speedup=1.35) is None  # a tie keeps the chain, which engines run too


def test_drafts_are_compared_by_the_decoding_they_chose():
    tree_wins = result(2, 1.05, 1.00, 1.10) | {"best_tree": "3,1", "trees": {"3,1": result(2, 1.60, 1.50, 1.70)}}
    candidates = {"initial": result(0, 1.20, 1.15, 1.25), "checkpoint-2": tree_wins}
    assert chosen_figures(tree_wins)["speedup"] == 1.60
    assert choose_best(candidates) == ("checkpoint-2", None)  # its tree's 1.50 lowest beats 1.25
    chain_only = candidates | {"checkpoint-2": tree_wins | {"best_tree": None}}
    assert choose_best(chain_only) == ("initial", None)


def test_a_card_gives_the_measurement_taken_after_the_choice():
    chosen = {**result(4, 1.24, 1.24, 1.24), "best_gamma": 1, "acceptance_rate": 0.35}
    assert card_figures(chosen) == chosen  # not measured again: the figures it was chosen by
    again = {**chosen, "confirmation": {"speedup": 1.17, "acceptance_rate": 0.33, "speedup_spread": None}}
    card = card_figures(again)
    assert (card["speedup"], card["acceptance_rate"], card["chosen_speedup"]) == (1.17, 0.33, 1.24)
    assert card["best_gamma"] == 1 and card["step"] == 4
    paused = {**chosen, "confirmation": {"speedup": 0.99, "acceptance_rate": None}}  # it never drafted
    assert (card_figures(paused)["speedup"], card_figures(paused)["acceptance_rate"]) == (0.99, 0.35)


def test_a_card_of_a_chosen_tree_gives_its_second_measurement_against_the_trees_figure():
    chosen = {**result(4, 1.10, 1.10, 1.10), "best_gamma": 2, "trees": {"3,1": {"speedup": 1.30}}, "best_tree": "3,1"}
    again = {**chosen, "confirmation": {"speedup": 1.21, "acceptance_rate": 0.4, "tree": "3,1", "nodes_per_round": 4.2}}
    card = card_figures(again)
    assert (card["speedup"], card["tree"], card["chosen_speedup"]) == (1.21, "3,1", 1.30)  # not the chain's 1.10


def test_a_draft_slower_than_the_target_alone_is_said_not_to_pay():
    line = does_not_pay("checkpoint-72", 0.96)
    assert line.startswith("checkpoint-72 does not pay here: it measured 0.96x the target alone")
    assert does_not_pay("checkpoint-72", 1.0) is None and does_not_pay("initial", None) is None
