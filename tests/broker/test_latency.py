from hypothesis import given, strategies as st

from zeroserve.broker.server.latency import LatencyBook, LatencyModel


def test_fits_fixed_plus_per_sample_cost():
    lm = LatencyModel()
    for b in (1, 2, 4, 8, 16) * 3:
        lm.observe(b, 0.002 + 0.0005 * b)
    assert abs(lm.predict(32) - (0.002 + 0.0005 * 32)) < 1e-6


def test_window_forgets_old_batches():
    lm = LatencyModel(window=8)
    for b in (1, 8) * 4:
        lm.observe(b, 1.0 * b)
    for b in (1, 8) * 4:
        lm.observe(b, 0.001 * b)
    assert abs(lm.predict(4) - 0.004) < 1e-6


def test_unknown_model_predicts_zero_and_one_size_scales():
    lm = LatencyModel()
    assert lm.predict(10) == 0.0
    lm.observe(4, 0.004)
    assert 0.003 < lm.predict(4) < 0.005


@given(st.lists(st.tuples(st.integers(1, 64), st.floats(0.0, 1.0)), min_size=1, max_size=200))
def test_predictions_are_never_negative(obs):
    lm = LatencyModel(window=16)
    for b, t in obs:
        lm.observe(b, t)
    assert all(lm.predict(b) >= 0 for b in (1, 8, 64))


def test_book_falls_back_to_the_model_wide_fit_and_can_be_off():
    book = LatencyBook()
    book.observe("m", "w1", 4, 0.004)
    assert book.predictor("m", "w2")(4) > 0  # a new worker borrows the model-wide fit
    assert LatencyBook(enabled=False).predictor("m", "w1")(4) == 0.0
