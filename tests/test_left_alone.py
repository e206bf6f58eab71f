"""Last (conftest sorts it after every other test): the tests left the checkout, its reports and releases, compose/.env
and the developer's own servers (Compose project servekit) as they found them."""

from __future__ import annotations

from support import left_as_found


def test_the_checkout_and_its_servers_are_as_the_tests_found_them():
    """Under pytest-xdist the controller makes the same check once every worker has ended (conftest)."""
    assert left_as_found() == {}
