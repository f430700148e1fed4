"""Samples longer than one training step: cut to train.batch_tokens with a warning in the job log, not only a count."""

from factories import random_samples, tiny_setup, train_tiny


def test_a_sample_cut_by_training_is_a_warning(tmp_path, capsys):
    inputs = tiny_setup(tmp_path, samples=random_samples(1, 40, 120) + random_samples(2, 16, 120, seed=1))
    train_tiny(tmp_path, inputs, train={"batch_tokens": 32})  # progress off: the warning still shows
    err = capsys.readouterr().err
    assert "warning: train: 1 sample(s) longer than train.batch_tokens = 32 are cut to 32 tokens" in err


def test_no_warning_when_every_sample_fits(tmp_path, capsys):
    inputs = tiny_setup(tmp_path, samples=random_samples(2, 16, 120))
    train_tiny(tmp_path, inputs, train={"batch_tokens": 32})
    assert "warning: train:" not in capsys.readouterr().err
