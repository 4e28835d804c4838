"""Requests that leave `temperature` unset: bypassed by default (OpenAI samples them at 1.0), served from
the cache where the operator opts in per model or tenant (`[cache] serve_unset_temperature*`, or the
admin API at run time).

The real gateway in front of the real built-in engine, the real openai SDK and SQLite."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from cachegw.gateway.request.tenants import key_hash
from tests.test_cache_reasons import logged_reason
from tests.test_gateway import MODEL, ask, backend_url, client, gateway, settings_for  # noqa: F401


def unset(url: str, question: str, key: str = "tenant-a") -> tuple[str, dict[str, str]]:
    """A chat completion with no temperature at all, as most SDK calls are sent."""
    raw = client(url, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=ask(question), max_tokens=8, seed=3
    )
    return raw.parse().choices[0].message.content or "", dict(raw.headers)


def test_unset_temperature_bypasses_by_default(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    with gateway(settings_for(tmp_path, [backend_url])) as url:
        for _ in range(2):
            _, headers = unset(url, "Name a colour of the sky.")
            assert (headers["x-cache"], headers["x-cache-reason"]) == ("bypass", "temperature")
    assert logged_reason(tmp_path, headers["x-request-id"]) == "temperature"


def test_on_for_a_model_serves_cached_answers_and_a_tenant_may_opt_out(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    settings = settings_for(
        tmp_path,
        [backend_url],
        serve_unset_temperature_by_model={MODEL: True},
        serve_unset_temperature_by_tenant={key_hash("tenant-b"): False},  # open mode: named by key hash
    )
    with gateway(settings) as url:
        first, h1 = unset(url, "Name a colour of the sky.")
        assert (h1["x-cache"], h1["x-cache-reason"]) == ("miss", "no-candidate")
        second, h2 = unset(url, "Name a colour of the sky.")
        assert (h2["x-cache"], h2["x-cache-reason"]) == ("exact-hit", "exact") and second == first
        _, other = unset(url, "Name a colour of the sky.", key="tenant-b")
        assert (other["x-cache"], other["x-cache-reason"]) == ("bypass", "temperature")
        # an explicit temperature > 0 is still a request for a sample
        raw = client(url).chat.completions.with_raw_response.create(
            model=MODEL, messages=ask("Name a colour of the sky."), max_tokens=8, temperature=0.7
        )
        assert raw.headers["x-cache-reason"] == "temperature"
    assert logged_reason(tmp_path, h2["x-request-id"]) == "exact"


def test_switched_on_at_run_time_through_the_admin_api(backend_url: str, tmp_path: Path) -> None:  # noqa: F811
    with gateway(settings_for(tmp_path, [backend_url])) as url:
        admin = {"authorization": f"Bearer {(tmp_path / 'admin_token').read_text().strip()}"}
        _, before = unset(url, "Name a large ocean.")
        assert before["x-cache"] == "bypass"
        on = {"unset_temperature": {"default": "on"}}  # a string is not a boolean, as on /v1
        bad = httpx.put(f"{url}/admin/api/settings", headers=admin, json=on, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "unset_temperature.default"
        put = httpx.put(
            f"{url}/admin/api/settings",
            headers=admin,
            json={"unset_temperature": {"models": {MODEL: True}}},
            timeout=30,
        )
        assert put.status_code == 200, put.text
        shown = httpx.get(f"{url}/admin/api/settings", headers=admin, timeout=30).json()
        assert shown["unset_temperature"] == {"default": False, "models": {MODEL: True}, "tenants": {}}
        first, h1 = unset(url, "Name a large ocean.")
        second, h2 = unset(url, "Name a large ocean.")
        assert (h1["x-cache"], h2["x-cache"]) == ("miss", "exact-hit") and second == first


@pytest.mark.parametrize("tenant_value", [True, False])
def test_tenant_setting_wins_over_the_model_setting(tenant_value: bool) -> None:
    from cachegw.gateway.config import load_settings

    c = load_settings(None).cache.model_copy(
        update={
            "serve_unset_temperature_by_model": {"m": not tenant_value},
            "serve_unset_temperature_by_tenant": {"t": tenant_value},
        }
    )
    assert c.serves_unset_temperature("m", "t") is tenant_value
    assert c.serves_unset_temperature("m", "other") is (not tenant_value)
    assert c.serves_unset_temperature("other", "other") is False  # the global default: off
