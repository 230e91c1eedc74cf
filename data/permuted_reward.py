"""The permuted-reward control of data/recipe.sh: GRPO with the paper's answer reward
1[answer = ground truth] computed for every sample, then shuffled among the samples of the
call (grpo.py calls its reward once a step on each rank, so among the step's samples). The
step's mean reward is the real one, but which sample gets a 1 says nothing about whether
it was right: a policy that improves under it improves for some other reason than the
reward (format, length, any update at all).

    torchrun --standalone --nproc_per_node=1 grpo.py --reward data/permuted_reward.py:permuted_reward ...
    torchrun --standalone --nproc_per_node=1 grpo.py --reward data/permuted_reward.py:group_permuted_reward ...

grpo.py logs `accuracy` from the real grade whatever the reward, so the control's curves
show what it actually solved.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import executor as ex  # noqa: E402


def answer_rewards(samples, problems) -> list[float]:
    """1.0 or 0.0 per sample: its own answer (`sample.pred`, from model-written text only)
    answers its problem by grpo.py's own verdict (`executor.correct`). `problems` holds one
    problem per group of len(samples) / len(problems) consecutive samples (G; 1 when aligned)."""
    G = len(samples) // len(problems)
    return [float(ex.correct(s.pred, problems[i // G])) for i, s in enumerate(samples)]


def permuted_reward(samples, problems, seed: int = 0) -> list[float]:
    """answer_rewards shuffled among the samples: the same values (same multiset, same mean),
    in an order drawn from an RNG seeded by `seed` and the problems' ids, so a rerun of the
    same step (a resumed run) gets the same order and two steps get different ones."""
    rewards = answer_rewards(samples, problems)
    rng = random.Random(f"{seed} {[str(p['id']) for p in problems]}")
    rng.shuffle(rewards)
    return rewards


def group_permuted_reward(samples, problems, args=None, seed: int = 0) -> list[float]:
    """answer_rewards shuffled within each group of G consecutive samples (`args.group_size`,
    grpo.py's `--group-size`, passed by batch_rewards; without `args`, each run of samples of
    one problem id): every group keeps its reward multiset, so the same groups carry signal and
    the advantages keep their sizes; only which sample of a group gets which reward is random.
    The fair control of data/recipe.sh's `control_group` (`permuted_reward` also moves rewards
    between groups, giving signal to groups that had none). Seeded by `seed`, the call's problem
    ids and the group's index, as `permuted_reward` (tests/faults.md P8)."""
    rewards = answer_rewards(samples, problems)
    per = len(samples) // len(problems)
    ids = [str(problems[i // per]["id"]) for i in range(len(samples))]
    if args is not None:
        bounds = range(0, len(rewards), args.group_size)
    else:   # runs of one problem id
        bounds = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    out = []
    for start, end in zip(bounds, [*bounds[1:], len(rewards)]):
        group = rewards[start:end]
        random.Random(f"{seed} {ids} {start}").shuffle(group)
        out += group
    return out
