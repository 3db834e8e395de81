import pytest

from llmkit.request import ALLOWED_TRANSITIONS, IllegalTransition, Request, RequestStatus
from llmkit.sampling import SamplingParams

S = RequestStatus


def test_legal_path():
    r = Request("a", [1, 2, 3])
    for s in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_STOPPED):
        r.set_status(s)
    assert r.is_finished and r.status.finish_reason == "stop"


@pytest.mark.parametrize("src", list(S))
def test_every_illegal_transition_raises(src):
    for dst in S:
        r = Request("a", [1])
        r.status = src
        if dst in ALLOWED_TRANSITIONS[src]:
            r.set_status(dst)
            assert r.status == dst
        else:
            with pytest.raises(IllegalTransition):
                r.set_status(dst)


def test_finished_states_are_terminal_and_map_to_reasons():
    assert {s.finish_reason for s in S if s.finished} == {"stop", "length", "abort", "error"}
    assert all(not ALLOWED_TRANSITIONS[s] for s in S if s.finished)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="empty"):
        Request("a", [])


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -2), ("max_tokens", 0), ("min_p", 2.0),
                                         ("n", 0)])
def test_sampling_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert SamplingParams(top_k=-1).top_k == 0
