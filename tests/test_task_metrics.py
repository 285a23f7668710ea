"""The model-free scores and loss of the paper's QA and coreference tasks: HotpotQA's official
metrics (`tasks.qa_metrics.hotpot_scores`), the SQuAD and TriviaQA answer normalisers, the
all-occurrence span loss, and MUC / B-cubed / CEAF-phi4 / CoNLL F1
(`tasks.coref_metrics.coref_scores`), each against cases worked by hand in the comments."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longformer_jax.tasks import coref_scores, hotpot_scores
from longformer_jax.tasks import coref_metrics, qa_metrics

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------------------------
# HotpotQA


def _gold(key, answer, facts):
  return {"_id": key, "answer": answer, "supporting_facts": [list(f) for f in facts],
          "question": "?", "type": "bridge", "level": "easy", "context": []}


FACTS = (("Paris", 0), ("Eiffel Tower", 2))


def test_hotpot_perfect_prediction_scores_one_everywhere():
  golds = [_gold("a", "Paris", FACTS), _gold("b", "yes", FACTS[:1])]
  predictions = {"answer": {"a": "paris.", "b": "Yes"},
                 "sp": {"a": [list(f) for f in reversed(FACTS)], "b": [list(FACTS[0])]}}
  scores = hotpot_scores(predictions=predictions, golds=golds)
  assert tuple(scores) == qa_metrics.HOTPOT_METRICS
  assert scores == dict.fromkeys(qa_metrics.HOTPOT_METRICS, 1.0)


def test_hotpot_partial_evidence():
  # Gold {(Paris, 0), (Eiffel Tower, 2)}, predicted those and (Eiffel Tower, 3): TP 2, FP 1,
  # FN 0 -> P 2/3, R 1, F1 = 2 (2/3) / (5/3) = 0.8, EM 0. The answer is right, so the joint
  # precision is 1 x 2/3, recall 1 x 1, F1 0.8, EM 1 x 0.
  golds = [_gold("a", "Paris", FACTS)]
  predictions = {"answer": {"a": "Paris"}, "sp": {"a": [*map(list, FACTS), ["Eiffel Tower", 3]]}}
  scores = hotpot_scores(predictions=predictions, golds=golds)
  assert scores["sp_prec"] == pytest.approx(2 / 3)
  assert scores["sp_recall"] == 1.0
  assert scores["sp_f1"] == pytest.approx(0.8)
  assert scores["sp_em"] == 0.0
  assert scores["joint_prec"] == pytest.approx(2 / 3)
  assert scores["joint_recall"] == 1.0
  assert scores["joint_f1"] == pytest.approx(0.8)
  assert scores["joint_em"] == 0.0


def test_hotpot_yes_no_mismatch_scores_zero_not_partial_credit():
  # "no" against gold "no way": one shared word would give P 1/2, R 1, F1 2/3 under plain
  # SQuAD F1; HotpotQA gives 0 because one side is a closed answer and they differ. Likewise
  # "yes" against "no" (no shared word either way) and "yes it is" against gold "yes".
  for prediction, gold in (("no", "no way"), ("yes", "no"), ("yes it is", "yes")):
    scores = hotpot_scores(predictions={"answer": {"a": prediction}, "sp": {"a": []}},
                           golds=[_gold("a", gold, FACTS)])
    assert (scores["em"], scores["f1"], scores["prec"], scores["recall"]) == (0, 0, 0, 0), gold
  # Two open answers sharing a word do earn partial credit: "the Seine river" vs "river".
  scores = hotpot_scores(predictions={"answer": {"a": "the Seine river"}, "sp": {}},
                         golds=[_gold("a", "river", FACTS)])
  assert (scores["prec"], scores["recall"], scores["f1"]) == pytest.approx((0.5, 1, 2 / 3))


def test_hotpot_corpus_with_a_missing_prediction_hand_computed():
  golds = [
      _gold("q1", "Paris", FACTS),                      # all right
      _gold("q2", "yes", FACTS),                        # answered "no", evidence right
      _gold("q3", "the Eiffel Tower in Paris", FACTS),  # partial answer, partial evidence
      _gold("q4", "1889", FACTS),                       # no answer predicted, evidence right
  ]
  facts = [list(f) for f in FACTS]
  predictions = {
      "answer": {"q1": "Paris", "q2": "no", "q3": "Eiffel Tower", "unknown": "x"},
      "sp": {"q1": facts, "q2": facts, "q3": [*facts, ["Paris", 5]], "q4": facts},
  }
  scores = hotpot_scores(predictions=predictions, golds=golds)
  # q3's answer: "eiffel tower" against "eiffel tower in paris": 2 shared words, P 1, R 1/2,
  # F1 2/3. Its evidence: P 2/3, R 1, F1 0.8. Joint: P 1 x 2/3, R 1/2 x 1, F1 = 2 (2/3)(1/2) /
  # (2/3 + 1/2) = (2/3) / (7/6) = 4/7. q4 scores 0 in every answer and joint metric; the
  # prediction of an unknown id is ignored. Means over the 4 gold records:
  expected = {
      "em": (1 + 0 + 0 + 0) / 4, "f1": (1 + 0 + 2 / 3 + 0) / 4,
      "prec": (1 + 0 + 1 + 0) / 4, "recall": (1 + 0 + 0.5 + 0) / 4,
      "sp_em": (1 + 1 + 0 + 1) / 4, "sp_f1": (1 + 1 + 0.8 + 1) / 4,
      "sp_prec": (1 + 1 + 2 / 3 + 1) / 4, "sp_recall": 1.0,
      "joint_em": (1 + 0 + 0 + 0) / 4, "joint_f1": (1 + 0 + 4 / 7 + 0) / 4,
      "joint_prec": (1 + 0 + 2 / 3 + 0) / 4, "joint_recall": (1 + 0 + 0.5 + 0) / 4,
  }
  assert scores == pytest.approx(expected)


@pytest.mark.parametrize("predictions, golds, problem", [
    ({"answer": {}}, [_gold("a", "x", FACTS)], "official prediction object"),
    ({"answer": {}, "sp": {}}, [], "no record"),
    ({"answer": {}, "sp": {}}, [{"_id": "a", "answer": "x"}], "golds[0] lacks supporting_facts"),
    ({"answer": {}, "sp": {}}, [_gold("a", "x", FACTS), _gold("a", "y", FACTS)],
     "golds[1]: _id 'a' repeats"),
    ({"answer": {"a": 3}, "sp": {}}, [_gold("a", "x", FACTS)], "predictions['answer']['a']"),
    ({"answer": {}, "sp": {"a": [["T", "0"]]}}, [_gold("a", "x", FACTS)],
     "predictions['sp']['a'][0] must be a [title (str), sentence id (int)] pair"),
])
def test_hotpot_refuses_malformed_input(predictions, golds, problem):
  with pytest.raises(ValueError) as info:
    hotpot_scores(predictions=predictions, golds=golds)
  assert problem in str(info.value), str(info.value)


# ----------------------------------------------------------------------------------------------
# Answer normalisers

TRIVIAQA_CASES = [("rock and roll", "rock-and-roll"), ("U S", "U.S."), ("New_York", "New York"),
                  ("\u2018Hamlet\u2019", "Hamlet")]


@pytest.mark.parametrize("a, b", TRIVIAQA_CASES)
def test_triviaqa_normaliser_matches_what_squads_does_not(a, b):
  triviaqa, squad = qa_metrics.get_normalizer("triviaqa"), qa_metrics.get_normalizer("squad")
  assert triviaqa(a) == triviaqa(b)  # exact match 1
  assert squad(a) != squad(b)        # exact match 0


def test_normalisers_by_hand():
  assert qa_metrics.normalize_triviaqa("  The Rock-and-Roll\u00b4s `Hall`_of_Fame!  ") == (
      "rock and roll s hall of fame")
  assert qa_metrics.normalize_answer("  The Rock-and-Roll's Hall_of_Fame!  ") == (
      "rockandrolls halloffame")
  assert qa_metrics.NORMALIZERS["squad"] is qa_metrics.normalize_answer
  with pytest.raises(ValueError, match="unknown answer normalizer 'bleu': expected one of "
                     "squad, triviaqa"):
    qa_metrics.get_normalizer("bleu")


def test_squad_normaliser_is_the_qa_kinds_one():
  # One normaliser: the QA kind scores with this module's (tasks.finetune_kinds imports it).
  from longformer_jax.tasks import finetune_kinds

  assert finetune_kinds.normalize_answer is qa_metrics.normalize_answer


# ----------------------------------------------------------------------------------------------
# The all-occurrence span loss


def _logsumexp(x):
  x = np.asarray(x, np.float64)
  top = x.max()
  return top + np.log(np.sum(np.exp(x - top)))


def _or_loss_reference(start_logits, end_logits, starts, ends):
  """Per row, by enumeration: the distinct gold positions' logsumexp against all positions'."""
  losses = []
  for s_logits, e_logits, s_gold, e_gold in zip(start_logits, end_logits, starts, ends):
    s_set, e_set = sorted({p for p in s_gold if p >= 0}), sorted({p for p in e_gold if p >= 0})
    if not s_set or not e_set:
      losses.append(0.0)
      continue
    start = _logsumexp(s_logits) - _logsumexp(s_logits[s_set])
    end = _logsumexp(e_logits) - _logsumexp(e_logits[e_set])
    losses.append((start + end) / 2)
  return np.asarray(losses)


def test_all_occurrence_loss_equals_a_numpy_logsumexp_reference():
  rng = np.random.default_rng(0)
  start_logits = rng.normal(size=(4, 12)).astype(np.float32) * 3
  end_logits = rng.normal(size=(4, 12)).astype(np.float32) * 3
  start_logits[:, :2] = end_logits[:, :2] = -1e9  # outside the context, as the kind masks it
  # Row 0: three occurrences, one start listed twice (two aliases sharing a start). Row 1: one
  # answer. Row 2: duplicates of both start and end, padding in between. Row 3: no answer.
  starts = np.array([[3, 7, 7, -1], [5, -1, -1, -1], [4, -1, 4, 9], [-1, -1, -1, -1]])
  ends = np.array([[4, 8, 9, -1], [6, -1, -1, -1], [6, -1, 6, 6], [-1, -1, -1, -1]])
  loss = qa_metrics.all_occurrence_span_loss(start_logits, end_logits, starts, ends)
  expected = _or_loss_reference(start_logits, end_logits, starts, ends)
  np.testing.assert_allclose(np.asarray(loss), expected, rtol=1e-5, atol=1e-5)
  assert loss[3] == 0.0 and all(loss[:3] > 0)
  # Row 0 without the masking (its start 7 counted twice) would be a different loss.
  once = _logsumexp(start_logits[0]) - _logsumexp(start_logits[0][[3, 7]])
  twice = _logsumexp(start_logits[0]) - _logsumexp(start_logits[0][[3, 7, 7]])
  assert abs(once - twice) > 0.1
  # One occurrence: the loss is the ordinary cross-entropy of that start and end.
  single = 0.5 * (-jax.nn.log_softmax(start_logits[1])[5] - jax.nn.log_softmax(end_logits[1])[6])
  np.testing.assert_allclose(float(loss[1]), float(single), rtol=1e-6)


def test_all_occurrence_loss_under_jit_with_finite_gradients():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(2, 2, 8)), jnp.float32)
  starts = jnp.array([[1, 1, 3], [-1, -1, -1]])
  ends = jnp.array([[2, 4, -1], [-1, -1, -1]])

  def total(logits):
    return qa_metrics.all_occurrence_span_loss(logits[0], logits[1], starts, ends).sum()

  value, grad = jax.jit(jax.value_and_grad(total))(logits)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_array_equal(np.asarray(grad[:, 1]), 0.0)  # the row without an answer
  # d/dlogit of (lse(all) - lse(gold)) / 2: (softmax - softmax over the golds) / 2.
  probabilities = np.asarray(jax.nn.softmax(logits[0, 0]))
  gold = np.zeros(8)
  gold[[1, 3]] = np.exp(np.asarray(logits[0, 0])[[1, 3]])
  np.testing.assert_allclose(np.asarray(grad[0, 0]), (probabilities - gold / gold.sum()) / 2,
                             rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Coreference: MUC, B-cubed, CEAF-phi4, CoNLL F1

# One-token mentions named by letter: a = (0, 0), b = (1, 1), ...
M = {name: (i, i) for i, name in enumerate("abcdefghijxyz")}


def _clusters(*names):
  return [[list(M[n]) for n in cluster] for cluster in names]


def _check(scores, expected):
  for metric, (p, r, f1) in expected.items():
    assert scores[metric] == pytest.approx({"p": p, "r": r, "f1": f1}), metric


def test_coref_hand_worked_example():
  # Key K1 = {a, b, c}, K2 = {d, e, f, g}; response R1 = {a, b}, R2 = {c, d}, R3 = {f, g, h, i}.
  key, response = _clusters("abc", "defg"), _clusters("ab", "cd", "fghi")
  # MUC recall: K1 splits into {a, b} (R1) and {c} (R2): 3 - 2 = 1; K2 into {d} (R2), {e}
  # (no response cluster), {f, g} (R3): 4 - 3 = 1; over (3 - 1) + (4 - 1) = 5 -> 2/5.
  # Precision: R1 in one part: 1; R2 in {c}, {d}: 0; R3 in {f, g}, {h}, {i}: 1; over 1 + 1 + 3
  # -> 2/5. F1 2/5.
  # B-cubed recall: K1: 2^2/3 + 1^2/3 = 5/3; K2: 1^2/4 + 2^2/4 = 5/4; (5/3 + 5/4) / 7 = 5/12.
  # Precision: R1: 2^2/2 = 2; R2: 1/2 + 1/2 = 1; R3: 2^2/4 = 1; 4 / 8 = 1/2.
  # F1 = 2 (5/12)(1/2) / (5/12 + 6/12) = (5/12) / (11/12) = 5/11.
  # CEAF-phi4: phi(K1, R1) = 2*2/5 = 4/5, phi(K1, R2) = 2/5, phi(K2, R2) = 2/6 = 1/3,
  # phi(K2, R3) = 2*2/8 = 1/2, the rest 0. Best alignment K1-R1, K2-R3: 4/5 + 1/2 = 13/10
  # (K1-R2 + K2-R3 = 9/10; K1-R1 + K2-R2 = 17/15). Recall 13/10 / 2 = 13/20, precision
  # 13/10 / 3 = 13/30, F1 = 2 (13/20)(13/30) / (13/20 + 13/30) = 338/650 = 0.52.
  expected = {"muc": (2 / 5, 2 / 5, 2 / 5), "b3": (1 / 2, 5 / 12, 5 / 11),
              "ceafe": (13 / 30, 13 / 20, 0.52)}
  for singletons in (True, False):  # neither side has a one-mention cluster: no difference
    scores = coref_scores(golds=[key], predictions=[response], singletons=singletons)
    _check(scores, expected)
    assert scores["conll_f1"] == pytest.approx((2 / 5 + 5 / 11 + 0.52) / 3)


def test_coref_ceafe_takes_the_best_alignment_not_the_greedy_one():
  # K1 = {a, b, c}, K2 = {d, e}; R1 = {a, b, d}, R2 = {c, e}. phi(K1, R1) = 2*2/6 = 2/3,
  # phi(K1, R2) = 2*1/5 = 2/5, phi(K2, R1) = 2*1/5 = 2/5, phi(K2, R2) = 2*1/4 = 1/2. Best:
  # K1-R1 + K2-R2 = 7/6 (the other alignment: 4/5). Recall and precision (7/6) / 2 = 7/12.
  scores = coref_scores(golds=[_clusters("abc", "de")], predictions=[_clusters("abd", "ce")])
  assert scores["ceafe"] == pytest.approx({"p": 7 / 12, "r": 7 / 12, "f1": 7 / 12})
  # K1 = {a, b}, K2 = {c, d}; R1 = {a, c}, R2 = {b, x, y}. phi(K1, R1) = phi(K2, R1) = 2/4 =
  # 1/2, phi(K1, R2) = 2/5, phi(K2, R2) = 0. Taking the largest pair first (K1-R1) leaves
  # K2-R2 = 0: 1/2 in all; the best alignment K1-R2 + K2-R1 = 2/5 + 1/2 = 9/10. Recall and
  # precision (9/10) / 2 = 9/20.
  scores = coref_scores(golds=[_clusters("ab", "cd")], predictions=[_clusters("ac", "bxy")])
  assert scores["ceafe"] == pytest.approx({"p": 9 / 20, "r": 9 / 20, "f1": 9 / 20})


def _one_token(clusters):
  return [[[int(m), int(m)] for m in c] for c in clusters]


def test_coref_ceafe_alignment_equals_every_permutation_tried():
  # Random small partitions: the similarity is the best sum of phi4 over every one-to-one
  # alignment of key and response clusters, enumerated.
  rng = np.random.default_rng(0)
  for _ in range(30):
    key = [list(c) for c in np.array_split(rng.permutation(9), int(rng.integers(1, 5))) if len(c)]
    response = [list(c) for c in np.array_split(rng.permutation(11), int(rng.integers(1, 5)))
                if len(c)]
    phi = [[2 * len(set(k) & set(r)) / (len(k) + len(r)) for r in response] for k in key]
    small, large = sorted((len(key), len(response)))
    best = max(sum(phi[i][j] if len(key) <= len(response) else phi[j][i]
                   for i, j in zip(range(small), perm))
               for perm in itertools.permutations(range(large), small))
    counts = coref_metrics.metric_counts(_one_token(key), _one_token(response))["ceafe"]
    assert counts == pytest.approx((best, len(response), best, len(key)))


def test_coref_singleton_conventions():
  # Key {a}, {b, c}; response {a}, {b}, {c}.
  key, response = _clusters("a", "bc"), _clusters("a", "b", "c")
  # Singletons scored (the reference scorer's way):
  # MUC recall: {a} 0 of 0, {b, c} split in two: 0 of 1 -> 0; precision 0 of 0 -> 0.
  # B-cubed recall: {a}: 1/1 = 1; {b, c}: 1/2 + 1/2 = 1; 2 / 3. Precision: 1 + 1 + 1 over 3 = 1.
  # F1 = 2 (2/3) / (5/3) = 4/5.
  # CEAFe: phi({a}, {a}) = 1, phi({b, c}, {b}) = phi({b, c}, {c}) = 2/3: 5/3 in all; recall
  # (5/3)/2 = 5/6, precision (5/3)/3 = 5/9, F1 = 2 (5/6)(5/9) / (5/6 + 5/9) = 2/3.
  scores = coref_scores(golds=[key], predictions=[response])
  _check(scores, {"muc": (0, 0, 0), "b3": (1, 2 / 3, 4 / 5), "ceafe": (5 / 9, 5 / 6, 2 / 3)})
  assert scores["conll_f1"] == pytest.approx((0 + 4 / 5 + 2 / 3) / 3)
  # Without singletons: the key is {b, c}, the response empty: every metric 0.
  scores = coref_scores(golds=[key], predictions=[response], singletons=False)
  _check(scores, {"muc": (0, 0, 0), "b3": (0, 0, 0), "ceafe": (0, 0, 0)})
  # A response {b, c}: perfect without singletons; with them the key's {a} is missed, in
  # B-cubed recall (0 + 2^2/2) / 3 = 2/3 (precision 2^2/2 / 2 = 1, F1 4/5).
  linked = [_clusters("bc")]
  assert coref_scores(golds=[key], predictions=linked, singletons=False)["conll_f1"] == 1.0
  scores = coref_scores(golds=[key], predictions=linked)
  assert scores["b3"] == pytest.approx({"p": 1, "r": 2 / 3, "f1": 0.8})


def test_coref_perfect_and_empty_predictions():
  key = _clusters("abc", "de", "f")
  perfect = coref_scores(golds=[key], predictions=[key])
  assert perfect["conll_f1"] == 1.0
  assert all(perfect[m] == {"p": 1.0, "r": 1.0, "f1": 1.0} for m in coref_metrics.METRICS)
  empty = coref_scores(golds=[key], predictions=[[]])
  assert empty["conll_f1"] == 0.0
  assert all(empty[m] == {"p": 0.0, "r": 0.0, "f1": 0.0} for m in coref_metrics.METRICS)


def test_coref_corpus_sums_counts_instead_of_averaging_documents():
  # Document 1: key {a, b, c, d, e} predicted exactly. Document 2: key {x, y}, response {x, z}.
  doc1 = _clusters("abcde")
  key2, response2 = _clusters("xy"), _clusters("xz")
  scores = coref_scores(golds=[doc1, key2], predictions=[doc1, response2])
  # MUC: document 1 links 4 of 4 both ways; document 2 splits {x, y} in two (0 of 1) and {x, z}
  # in two (0 of 1): 4/5 each way, F1 4/5 (the mean of the documents' F1 would be 1/2).
  # B-cubed: document 1 5 of 5; document 2 recall 1^2/2 of 2 mentions, precision likewise:
  # (5 + 1/2) / 7 = 11/14 each way.
  # CEAFe: document 1 similarity 1 of 1; document 2 phi = 2/4: 1.5 / 2 both ways.
  _check(scores, {"muc": (4 / 5, 4 / 5, 4 / 5), "b3": (11 / 14, 11 / 14, 11 / 14),
                  "ceafe": (3 / 4, 3 / 4, 3 / 4)})
  per_document = [coref_scores(golds=[k], predictions=[r])["conll_f1"]
                  for k, r in ((doc1, doc1), (key2, response2))]
  # Document 2 alone: MUC 0, B-cubed (1/2) / 2 = 1/4, CEAFe 1/2 -> 1/4; the mean of the two
  # documents' CoNLL F1 is 5/8, the corpus's (4/5 + 11/14 + 3/4) / 3 = 0.779.
  assert per_document == pytest.approx([1.0, 1 / 4])
  assert scores["conll_f1"] == pytest.approx((4 / 5 + 11 / 14 + 3 / 4) / 3)
  assert abs(scores["conll_f1"] - np.mean(per_document)) > 0.1
  # Mappings by document key score the same; an absent document is an empty prediction.
  by_key = coref_scores(golds={"d1": doc1, "d2": key2}, predictions={"d1": doc1, "d2": response2})
  assert by_key == scores
  absent = coref_scores(golds={"d1": doc1, "d2": key2}, predictions={"d1": doc1})
  assert absent == coref_scores(golds=[doc1, key2], predictions=[doc1, []])


def test_coref_repeated_response_mention_counts_once_where_it_first_occurs():
  key = _clusters("abc")
  # b repeated in a later cluster: that occurrence is dropped, the response is {a, b}, {c}.
  repeated = coref_scores(golds=[key], predictions=[_clusters("ab", "bc")])
  assert repeated == coref_scores(golds=[key], predictions=[_clusters("ab", "c")])
  # By hand: MUC recall: {a, b, c} in parts {a, b}, {c}: 1 of 2; precision {a, b} 1 of 1, {c}
  # 0 of 0: 1. B-cubed recall (2^2/3 + 1/3) / 3 = 5/9, precision (2^2/2 + 1/1) / 3 = 1.
  # CEAFe: phi(K, {a, b}) = 4/5, phi(K, {c}) = 2/4: 4/5; recall 4/5, precision 2/5.
  _check(repeated, {"muc": (1, 1 / 2, 2 / 3), "b3": (1, 5 / 9, 10 / 14),
                    "ceafe": (2 / 5, 4 / 5, 8 / 15)})
  # Repeated in its own cluster: counted once.
  assert coref_scores(golds=[key], predictions=[_clusters("aab")]) == coref_scores(
      golds=[key], predictions=[_clusters("ab")])
  # The first occurrence is the one kept: {b, c}, {a, b} -> {b, c}, {a}.
  assert coref_scores(golds=[key], predictions=[_clusters("bc", "ab")]) == coref_scores(
      golds=[key], predictions=[_clusters("bc", "a")])
  # A repeated mention that matches no gold mention counts once too: {x, x} is the singleton
  # {x}, so B-cubed precision is (2^2/2 + 0) / 3 = 2/3 (twice, it would be 2 / 4).
  twinless = coref_scores(golds=[_clusters("ab")], predictions=[_clusters("ab", "xx")])
  assert twinless["b3"]["p"] == pytest.approx(2 / 3)
  # A cluster left with one mention is a singleton: scored by default, dropped without them.
  counts = coref_metrics.metric_counts(key, _clusters("ab", "bc"), singletons=False)
  assert counts == coref_metrics.metric_counts(key, _clusters("ab"), singletons=False)


def test_coref_multi_token_spans_and_numpy_ints():
  # Spans are compared whole: (0, 1) is not (0, 0).
  key = [[[0, 1], [5, 7]]]
  assert coref_scores(golds=[key], predictions=[[[[0, 1], [5, 7]]]])["conll_f1"] == 1.0
  assert coref_scores(golds=[key], predictions=[[[[0, 0], [5, 7]]]])["muc"]["r"] == 0.0
  as_numpy = [[np.array([0, 1]), np.array([5, 7])]]
  assert coref_scores(golds=[key], predictions=[as_numpy])["conll_f1"] == 1.0


@pytest.mark.parametrize("golds, predictions, problem", [
    ([], [], "golds holds no document"),
    ([[]], [[], []], "need one prediction per gold document: got 2 predictions for 1"),
    ({"d": []}, [[]], "both be lists of documents or both mappings"),
    ({"d": []}, {"e": []}, "predictions name documents that golds lacks: ['e']"),
    ([[[[0, 1]]]], [[[[2, 1]]]], "document 0 prediction cluster 0 mention 0 must be a [start, "
     "end] pair"),
    ([[[[0, 1], [3]]]], [[]], "document 0 gold cluster 0 mention 1"),
    ([[[[0, True]]]], [[]], "document 0 gold cluster 0 mention 0"),
    ([["ab"]], [[]], "document 0 gold cluster 0 must be a list"),
])
def test_coref_refuses_malformed_input(golds, predictions, problem):
  with pytest.raises(ValueError) as info:
    coref_scores(golds=golds, predictions=predictions)
  assert problem in str(info.value), str(info.value)
