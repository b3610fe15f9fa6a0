"""Send a JobPlan with the official SDK (`huaweicloudsdkmodelarts`, the `job` extra): credentials from the
environment only, the body turned into the SDK's request models field by field, refusals as one line."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping, Optional

from kit.errors import KitError, debug_enabled
from kit.system.waits import seconds
from kit.train.job.request import JobPlan, redact

# the SDK's own variable names (huaweicloudsdkcore auth/provider.py EnvCredentialProvider)
AK_ENV, SK_ENV = "HUAWEICLOUD_SDK_AK", "HUAWEICLOUD_SDK_SK"
PROJECT_ENV, TOKEN_ENV = "HUAWEICLOUD_SDK_PROJECT_ID", "HUAWEICLOUD_SDK_SECURITY_TOKEN"
REGION_ENV = "HUAWEICLOUD_SDK_REGION"  # e.g. cn-southwest-2 (ModelArts' endpoint for it comes from the SDK)
ENDPOINT_ENV = "KIT_MODELARTS_ENDPOINT"  # an explicit endpoint instead, e.g. https://modelarts.<region>.myhuaweicloud.com
# seconds to connect, and to wait for the answer (the SDK's defaults are 60 and 120); KIT_MODELARTS_TIMEOUT_S sets
# the second. A create request is never retried: one whose answer was lost may have created the job.
CONNECT_S, READ_S, READ_ENV = 10.0, 60.0, "KIT_MODELARTS_TIMEOUT_S"
ANSWER_CHARS = 300  # of an error answer's text in the one line (a gateway may answer a whole HTML page)


class JobSubmitError(KitError):
    """ModelArts refused the job, or it could not be sent (message: one line, credentials redacted)."""


def _sdk():
    try:
        import huaweicloudsdkmodelarts.v1 as sdk
    except ImportError as exc:
        raise JobSubmitError(
            f"submitting needs the ModelArts SDK ({exc}): pip install 'ascend-notebook-kit[job]' "
            "(or huaweicloudsdkmodelarts); the dry run works without it."
        ) from None
    return sdk


def to_sdk(body: dict) -> Any:
    """The SDK's `Job` model holding exactly `body` (an unknown field is an error, so nothing is dropped)."""
    sdk = _sdk()

    def model(cls: type, data: dict) -> Any:
        by_json = {v: k for k, v in cls.attribute_map.items()}
        kwargs = {}
        for key, value in data.items():
            if key not in by_json:
                raise JobSubmitError(
                    f"the SDK's {cls.__name__} has no field {key!r}; the kit built a bad body."
                )
            attr = by_json[key]
            kwargs[attr] = convert(cls.openapi_types[attr], value)
        return cls(**kwargs)

    def convert(type_name: str, value: Any) -> Any:
        if (
            value is None
            or type_name in ("str", "int", "bool", "float", "object")
            or type_name.startswith("dict(")
        ):
            return value
        if type_name.startswith("list["):
            return [convert(type_name[5:-1], v) for v in value]
        return model(getattr(sdk, type_name), value)

    return model(sdk.Job, body)


def serialized(body: dict) -> dict:
    """What the SDK puts on the wire for `body` (its own serializer), for checking that the two are equal."""
    from huaweicloudsdkcore.utils import http_utils

    return http_utils.sanitize_for_serialization(to_sdk(body))


def client(environ: Optional[Mapping[str, str]] = None) -> Any:
    """A ModelArtsClient from the environment: AK/SK/project (+ security token), region or endpoint."""
    environ = os.environ if environ is None else environ
    missing = [k for k in (AK_ENV, SK_ENV, PROJECT_ENV) if not environ.get(k)]
    if not (environ.get(REGION_ENV) or environ.get(ENDPOINT_ENV)):
        missing.append(f"{REGION_ENV} (or {ENDPOINT_ENV})")
    if missing:
        raise JobSubmitError(
            f"submitting needs {', '.join(missing)} in the environment (an IAM user's access keys and the project "
            "of the job's region); export them in the terminal or the kernel's environment, never in a notebook."
        )
    sdk = _sdk()
    if not debug_enabled():
        # the SDK logs each failure itself, through Python's last-resort handler (stderr) when its logger has none:
        # a second line beside the kit's; it shows only with --debug
        logger = logging.getLogger(f"HuaweiCloud-SDK-{sdk.ModelArtsClient.__name__}")
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
    from huaweicloudsdkcore.auth.credentials import BasicCredentials

    creds = BasicCredentials(environ[AK_ENV], environ[SK_ENV], environ[PROJECT_ENV])
    if environ.get(TOKEN_ENV):
        creds = creds.with_security_token(environ[TOKEN_ENV])
    from huaweicloudsdkcore.http.http_config import HttpConfig

    http = HttpConfig.get_default_config()
    http.timeout = (CONNECT_S, read_timeout(environ))
    builder = sdk.ModelArtsClient.new_builder().with_credentials(creds).with_http_config(http)
    if environ.get(ENDPOINT_ENV):
        builder = builder.with_endpoint(environ[ENDPOINT_ENV])
    else:
        from huaweicloudsdkmodelarts.v1.region.modelarts_region import ModelArtsRegion

        try:
            region = ModelArtsRegion.value_of(environ[REGION_ENV])
        except KeyError:
            raise JobSubmitError(
                f"{REGION_ENV}={environ[REGION_ENV]!r} is not a ModelArts region the SDK knows; give the region "
                f"ID (e.g. cn-southwest-2) or set {ENDPOINT_ENV}."
            ) from None
        builder = builder.with_region(region)
    return builder.build()


def read_timeout(environ: Mapping[str, str]) -> float:
    """Seconds to wait for ModelArts' answer: KIT_MODELARTS_TIMEOUT_S, else READ_S."""
    return seconds(environ, READ_ENV, READ_S)


def submit(plan: JobPlan, environ: Optional[Mapping[str, str]] = None) -> str:
    """Create the training job; return its ID. Refuses a plan with problems; a refusal is one explained line."""
    from kit.core.known_errors import explain

    environ = os.environ if environ is None else environ
    if plan.problems:
        raise JobSubmitError(
            f"the job has {len(plan.problems)} problem(s), so it was not sent: {plan.problems[0]}"
            + (" (the dry run lists them all)" if len(plan.problems) > 1 else "")
        )
    sdk = _sdk()
    from huaweicloudsdkcore.exceptions import exceptions as sdk_errors
    from requests.exceptions import (
        ReadTimeout,
        RequestException,
    )  # a connect timeout sent nothing: the latter

    request = sdk.CreateTrainingJobRequest(body=to_sdk(plan.body))
    api = client(environ)
    try:
        response = api.create_training_job(request)
    except sdk_errors.ServiceResponseException as exc:
        text = f"HTTP {exc.status_code} {exc.error_code or ''}: {_answer(exc.error_msg)}".replace("  ", " ")
        raise JobSubmitError(
            _one_line(f"ModelArts refused the job ({text})", explain(text), environ)
        ) from None
    except (sdk_errors.RequestTimeoutException, ReadTimeout) as exc:  # sent, never answered: it may exist
        where = environ.get(ENDPOINT_ENV) or f"region {environ.get(REGION_ENV)}"
        name = plan.body.get("metadata", {}).get("name")
        raise JobSubmitError(
            _one_line(
                f"ModelArts ({where}) did not answer the job request within {read_timeout(environ):g} s "
                f"({type(exc).__name__}); the job may have been created all the same: look for training job "
                f"{name!r} in the ModelArts console (Training Jobs) before you submit again",
                None,
                environ,
            )
        ) from None
    except (sdk_errors.ConnectionException, RequestException) as exc:
        raise JobSubmitError(
            _one_line(
                f"could not reach ModelArts ({type(exc).__name__}: {getattr(exc, 'error_msg', exc)}); check {REGION_ENV} / "
                f"{ENDPOINT_ENV} and the network",
                None,
                environ,
            )
        ) from None
    except sdk_errors.SdkException as exc:  # any other failure the SDK reports (e.g. a RetryError)
        raise JobSubmitError(
            _one_line(
                f"the job could not be sent ({type(exc).__name__}: {_answer(exc.error_msg)})", None, environ
            )
        ) from exc  # its traceback (with --debug) shows the SDK's
    job_id = getattr(getattr(response, "metadata", None), "id", None)
    if not job_id:
        raise JobSubmitError(
            f"ModelArts answered HTTP {response.status_code} without a job ID; check the console."
        )
    return job_id


def _answer(text: Any) -> str:
    """An error answer's text for one line: markup and comments dropped, at most ANSWER_CHARS characters."""
    text = " ".join(re.sub(r"<!--.*?-->|<[^>]*>", " ", str(text or ""), flags=re.S).split())
    return text if len(text) <= ANSWER_CHARS else text[: ANSWER_CHARS - 3] + "..."


def _one_line(what: str, explanation: Any, environ: Mapping[str, str]) -> str:
    text = what if explanation is None else f"{what} — {explanation.cause} Fix: {explanation.fix}"
    return redact(" ".join(text.split()), environ)
