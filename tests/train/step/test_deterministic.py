"""The deterministic engine's RNG states as plain types (a checkpoint of it loads with weights_only=True).
Its exact resume runs in tests/distributed/test_training.py. `python -m pytest
tests/train/step/test_deterministic.py`."""

import torch

from ignite_mgpu.train.step.deterministic import native_rng_states, plain_rng_states


def test_rng_states_become_plain_types_and_come_back():
    import random

    import numpy as np
    from ignite.engine.deterministic import _get_rng_states

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    states = _get_rng_states()  # what ignite's DeterministicEngine saves: [random, torch, numpy]
    plain = plain_rng_states(states)
    assert isinstance(plain[2][1], torch.Tensor)
    back = native_rng_states(plain)
    assert back[0] == states[0] and torch.equal(back[1], states[1])
    assert back[2][0] == "MT19937" and back[2][1].dtype == np.uint32 and np.array_equal(back[2][1], states[2][1])
    assert back[2][2:] == states[2][2:]
    np.random.set_state(back[2])
    first = np.random.rand()
    np.random.set_state(states[2])
    assert np.random.rand() == first
    assert native_rng_states(states) is states  # ignite's own form (older checkpoints) passes through
