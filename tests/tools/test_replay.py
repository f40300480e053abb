"""The offline replay: the perfect proposer follows the reference the context is on, and the walk counts passes as
the loop makes them."""

import numpy as np

from specula.policy.adaptive import FixedDrafts
from specula.tools.replay import Replay, walk


def test_replay_follows_the_reference_the_context_is_on() -> None:
    replay = Replay([[1, 2, 3, 4, 5], [1, 7, 8, 9]], num_draft=2)
    assert replay.propose(np.array([1, 2]), 5).tokens.tolist() == [3, 4]
    assert replay.propose(np.array([1, 7]), 1).tokens.tolist() == [8]
    assert len(replay.propose(np.array([1, 3]), 5)) == 0  # on neither
    assert len(replay.propose(np.array([1, 2, 3, 4, 5]), 5)) == 0  # at the end


def test_walk_counts_the_prefill_and_one_pass_per_block() -> None:
    prompt, output = [5, 6], list(range(10, 30))  # 20 tokens: the prefill's, 3 blocks of 4 drafts + 1, the last 3 + 1
    passes, drafted, seconds = walk(Replay([prompt + output], 4), prompt, output, FixedDrafts(4), np.array([1.0, 1.5]))
    assert (passes, drafted) == (1 + 4, 15) and seconds == 1.0 + 4 * 1.5
    nothing = Replay([[0]], 4)  # never right: every token takes a pass of its own
    assert walk(nothing, prompt, output, FixedDrafts(4), np.ones(1))[:2] == (20, 0)
