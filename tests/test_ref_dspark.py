"""Reference DSpark: greedy speculative decoding emits the plain greedy tokens; acceptance, rollback."""
import numpy as np
from ref_model import block_step, new_caches, random_prompt, tiny_model

from executor.reference import dspark
from executor.reference.prefill import prefill


def _plain_greedy(model, prompt, count):
    """Greedy decoding one token per step (prefill, then single decode rows)."""
    caches = new_caches(model)
    seq = list(prompt)
    seq.append(prefill(model, caches, 0, prompt).next_token)
    while len(seq) < len(prompt) + count:
        out = block_step(model, caches, 0, len(seq) - 1, [seq[-1]], seq)
        seq.append(int(out.tokens[0]))
    return seq[len(prompt):]


def test_dspark_emits_exactly_the_plain_greedy_tokens():
    model = tiny_model(2)
    prompt = random_prompt(np.random.default_rng(), 7)
    result = dspark.generate(model, new_caches(model), prompt, 8)
    assert result.tokens[:8] == _plain_greedy(model, prompt, 8)
    for r in result.rounds:
        assert len(r.drafts) == 5 and 0 <= r.accepted <= 5 and len(r.emitted) == r.accepted + 1


def test_scripted_drafts_are_accepted_up_to_the_first_miss_and_rolled_back(monkeypatch):
    model = tiny_model(1)
    rng = np.random.default_rng()
    prompt = random_prompt(rng, 8)
    truth = _plain_greedy(model, prompt, 24)
    # Per round: how many leading drafts are right (5 = all, then a bonus from the last row).
    script = [5, 2, 0, 3, 1]
    emitted = [truth[0]]
    rounds = []

    def scripted(model_, caches, seq):
        right = script[len(rounds)]
        upcoming = truth[len(emitted):len(emitted) + 5]
        wrong = [(t + 1 + int(rng.integers(0, 1000))) % 1023 for t in upcoming]
        drafts = tuple(upcoming[:right] + wrong[right:])
        rounds.append(right)
        return drafts

    monkeypatch.setattr(dspark, "draft", scripted)
    caches = new_caches(model)
    seq, _ = dspark.start_sequence(model, caches, 0, prompt)
    for want in script:
        accepted, out = dspark.verify_and_accept(model, caches, seq, dspark.draft(model, caches, seq))
        assert accepted == want
        emitted.extend(out)
        # Rolled back: no compressor ring row holds a position at or past the accepted length.
        for ring_pos in caches.ring_pos.values():
            assert (ring_pos[0] < seq.position).all()
        assert seq.tokens == prompt + emitted[:-1] and seq.bonus == emitted[-1]
    assert emitted == truth[:len(emitted)]
    assert len(emitted) == 1 + sum(a + 1 for a in script)


def test_markov_head_split_argmax_matches_the_full_vocabulary():
    model = tiny_model(4)
    rng = np.random.default_rng()
    cfg = model.cfg
    last = cfg.num_layers_total - 1
    w1 = model.ranks[0].layer(last).vector("markov_head.markov_w1.weight").astype(np.float64)
    w2 = np.concatenate([r.layer(last).vector("markov_head.markov_w2.weight") for r in model.ranks])
    # Small base logits so the Markov term decides: the chain must feed each draft back in.
    base = (rng.normal(0, 0.02, (5, cfg.vocab_size))).astype(np.float32)
    shards = np.split(base, 4, axis=1)
    anchor = int(rng.integers(0, cfg.vocab_size))
    got = dspark.markov_drafts(model, shards, anchor)
    prev, want = anchor, []
    for i in range(5):
        prev = int(np.argmax(base[i].astype(np.float64) + w2.astype(np.float64) @ w1[prev]))
        want.append(prev)
    assert list(got) == want
    assert list(got) != np.argmax(base, axis=1).tolist()
