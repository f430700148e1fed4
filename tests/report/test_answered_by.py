"""The report says per dataset what answered its completions: the engine, and for a server the model it served."""

from eyrie.report.collect_data import answered_by


def test_a_server_shard_names_the_engine_and_the_served_model():
    meta = {"stats": {"run": {"engine": "openai"}}, "served": {"engine": "openai", "model": "org/tiny-target", "key": "abc"}}
    assert answered_by(meta) == "openai: org/tiny-target"


def test_an_in_process_shard_names_its_engine_and_a_resumed_one_its_log():
    assert answered_by({"stats": {"run": {"engine": "transformers"}}}) == "transformers"
    assert answered_by({"stats": {"run": {"engine": None}}}) == "resume log"
    assert answered_by({}) is None
