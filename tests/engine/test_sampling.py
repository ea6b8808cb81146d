"""The batched sampler against reference implementations on fixed logits: transformers' own logits
processors for repetition penalty, temperature, top-k, top-p and min-p, and a row-by-row loop of the
OpenAI formula for frequency and presence penalties."""
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from app.engine.errors import InvalidSamplingParams
from app.engine.sampling import SamplingParams, TokenSampler, distribution, penalize, sample_batch

V = 300
CPU = torch.device("cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 3


def _reference_distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = row.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if 0 < p.top_k < V:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0]


PARAMS = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.5, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=2.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.01),
]


def test_the_batched_distribution_matches_transformers_warpers_row_by_row():
    logits = _logits(len(PARAMS))
    probs = distribution(logits.clone(), PARAMS)
    for i, p in enumerate(PARAMS):
        ref = _reference_distribution(logits[i], p)
        # min-p in transformers renormalises nothing (it masks logits); the probabilities it keeps are
        # those of the softmax before it, so compare after renormalising both.
        ours = probs[i] / probs[i].sum()
        assert torch.equal(ours > 0, ref > 0), f"row {i}: a different set of tokens kept"
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_the_stages_drop_what_they_should():
    logits = _logits(1, seed=3)
    kept = (distribution(logits, [SamplingParams(temperature=1.0, top_k=7)]) > 0).sum().item()
    assert kept == 7
    probs = distribution(logits, [SamplingParams(temperature=1.0, min_p=0.5)])[0]
    assert (probs[probs > 0] >= 0.5 * probs.max()).all()
    full = torch.softmax(logits[0], dim=-1)
    nucleus = distribution(logits, [SamplingParams(temperature=1.0, top_p=0.6)])[0]
    kept_mass = full[nucleus > 0].sum().item()
    assert kept_mass >= 0.6 and kept_mass - full[nucleus > 0].min().item() < 0.6


def _reference_penalties(row: torch.Tensor, context: list[int], reply: list[int], p: SamplingParams) -> torch.Tensor:
    scores = row.unsqueeze(0).clone()
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([context + reply])
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    out = scores[0].clone()
    for token in set(reply):  # the OpenAI formula, a token at a time
        count = reply.count(token)
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, temperature=0.7),
    SamplingParams(frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(repetition_penalty=1.1, frequency_penalty=-1.5, presence_penalty=1.2),
])
def test_penalties_match_the_references_over_conversation_and_reply(params):
    context = [5, 17, 17, 42, 299]
    reply = [42, 8, 8, 8, 100]
    sampler = TokenSampler(params, CPU, context)
    logits = _logits(1, seed=9)
    sampler.state(V, CPU)
    for token in reply:
        sampler.add(torch.tensor(token))
    ours = penalize(logits.clone(), [sampler])[0]
    torch.testing.assert_close(ours, _reference_penalties(logits[0], context, reply, params))


def test_a_batch_mixes_plain_greedy_penalised_and_seeded_rows_each_as_alone():
    logits = _logits(4, seed=11)
    # Row 0 plain greedy; row 1 greedy with a penalty that must move its argmax; rows 2, 3 seeded.
    top = int(torch.argmax(logits[1]))
    logits[1, top] = logits[1].sort(descending=True).values[1] + 0.01  # just above the runner-up
    params = [SamplingParams(), SamplingParams(presence_penalty=2.0),
              SamplingParams(temperature=0.9, top_k=20, seed=1), SamplingParams(temperature=1.1, min_p=0.05, seed=2)]

    def samplers():
        made = [TokenSampler(p, CPU) for p in params]
        made[1].state(V, CPU)
        made[1].add(torch.tensor(top))  # the reply already used the top token once
        return made

    together = sample_batch(logits, samplers())
    alone = [sample_batch(logits[i : i + 1], [s])[0] for i, s in enumerate(samplers())]
    assert together == alone
    assert together[0] == top_plain(logits[0])
    assert together[1] != top, "the presence penalty moved row 1 off the token its reply already used"


def top_plain(row: torch.Tensor) -> int:
    return int(torch.argmax(row))


def test_a_sampler_counts_what_it_draws_and_sees_its_conversation():
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)
    context = [1, 2, 3]
    sampler = TokenSampler(params, CPU, context)
    context.append(4)  # the caller's list grows; the sampler kept its own copy
    logits = torch.zeros(1, V)
    logits[0, 50] = 10.0
    drawn = [sample_batch(logits, [sampler])[0] for _ in range(3)]
    assert drawn == [50, 50, 50]
    seen, counts = sampler.state(V, CPU)
    assert counts[50].item() == 3 and counts.sum().item() == 3
    assert seen[[1, 2, 3, 50]].all() and not seen[4]


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0),
    ("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("top_k", 1.5),
])
def test_out_of_range_values_are_refused_with_the_field_named(field, value):
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams.parse(**{field: value})
