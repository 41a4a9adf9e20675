"""The integration tier: the real servers the service works with (redis-server, prometheus, chromium: Debian
packages) and Ray Serve clusters with the embedded and mock engines."""

from tests.fixtures.browser import browser_context, browser_page  # noqa: F401
from tests.fixtures.redis import redis_server, redis_server_module  # noqa: F401
