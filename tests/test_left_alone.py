"""Last (conftest sorts it after every other test): the tests left the checkout, its reports and releases, compose/.env
and the developer's own servers (Compose project servekit) as they found them."""

from __future__ import annotations

from support import STATE_AT_START, checkout_state


def test_the_checkout_and_its_servers_are_as_the_tests_found_them():
    now = checkout_state()
    assert {k: v for k, v in now.items() if v != STATE_AT_START[k]} == {}
