"""Which stream each authenticated subscription reaches (kvtier.events.streams), and topics that cannot work."""

import pytest

from kvtier.errors import ConfigError
from kvtier.events.streams import check_topic, subscription_for, tenant_topic

TOPIC = b"kv-events"


def test_a_tenant_is_only_ever_subscribed_inside_its_own_prefix():
    assert subscription_for("team-a", b"", TOPIC) == b"tenant:team-a/"
    assert subscription_for("team-a", b"kv", TOPIC) == b"tenant:team-a/kv"
    assert subscription_for("team-a", tenant_topic("team-a", TOPIC), TOPIC) == b"tenant:team-a/kv-events"
    # naming another tenant's stream lands inside its own prefix
    assert subscription_for("team-a", b"tenant:team-b/", TOPIC) == b"tenant:team-a/tenant:team-b/"
    assert subscription_for("team-a", b"tenant:team-a", TOPIC) == b"tenant:team-a/tenant:team-a"


def test_the_operator_gets_the_operator_stream_or_a_tenant_stream_it_names():
    assert subscription_for("*", b"", TOPIC) == TOPIC
    assert subscription_for("*", b"kv-", TOPIC) == TOPIC
    assert subscription_for("*", b"tenant:team-b/", TOPIC) == b"tenant:team-b/"
    assert subscription_for(None, b"", TOPIC) is None


@pytest.mark.parametrize("topic", [b"", b"t", b"tenant", b"tenant:", b"tenant:x/kv"])
def test_topics_that_would_overlap_tenant_streams_are_refused(topic):
    with pytest.raises(ConfigError, match="kv_events.topic"):
        check_topic(topic)


def test_an_ordinary_topic_is_accepted():
    check_topic(TOPIC)
