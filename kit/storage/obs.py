"""OBS (Huawei Cloud object storage) through its official SDK, `esdk-obs-python` (the optional extra `obs`).

Glue, not a client: the SDK signs requests and does multipart, threaded and resumable uploads (`uploadFile` with
`enableCheckpoint`); downloads are the SDK's ranged GETs, CRC'd as they arrive (kit.storage.obs_download). This module adds
what the SDK has no notion of: a folder is complete in OBS only when its listing (`kit_obs_files.json`: size and
CRC-32 of every file) is uploaded, last; a download is resumable (files already here with the listed size and CRC
are kept, a cut file resumes at its next part) and verified against that listing before it is used. Credentials
come only from the environment and are never written anywhere.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from kit.errors import InputError, KitError, MissingInputError
from kit.storage.atomic import MANIFEST_NAME, OutputExistsError
from kit.storage.hashes import crc32_file, sha256_file
from kit.storage.obs_lease import Lease
from kit.system.waits import seconds

SCHEME = "obs://"
LISTING = "kit_obs_files.json"  # uploaded last: the folder above it is complete in OBS
PART_SIZE = (
    9 * 1024 * 1024
)  # the SDK's own default part size (S3 servers refuse parts under 5 MiB but the last)
THREADS = 4  # parts in flight per file
SDK_RECORDS = (
    ".upload_record",
    ".download_record",
)  # the SDK's resume records beside a file being transferred
# (access key, secret key) variable pairs, first found wins: the Huawei Cloud SDKs' names, then the OBS SDK's own
KEY_VARIABLES = (("HUAWEICLOUD_SDK_AK", "HUAWEICLOUD_SDK_SK"), ("OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY"))
TOKEN_VARIABLES = ("HUAWEICLOUD_SDK_SECURITY_TOKEN", "OBS_SECURITY_TOKEN")
ENDPOINT_VARIABLE = "OBS_ENDPOINT"  # e.g. https://obs.cn-southwest-2.myhuaweicloud.com
SIGNATURE_VARIABLE = "OBS_SIGNATURE"  # obs (default: OBS's own, negotiated) | v4 | v2 (S3-compatible servers)
# each request: connect and every read wait at most TIMEOUT_VARIABLE seconds (default 30), and the SDK tries it
# RETRIES more times, so a server that stops answering ends a request within (RETRIES + 1) x the timeout
TIMEOUT_VARIABLE, TIMEOUT_S, RETRIES = "KIT_OBS_TIMEOUT_S", 30.0, 2


class ObsError(KitError, OSError):
    """An OBS request failed (the message names the object, the HTTP status and OBS's error code)."""


def is_obs(path: Optional[str]) -> bool:
    return bool(path) and str(path).startswith(SCHEME)


def split(url: str) -> Tuple[str, str]:
    """obs://bucket/some/prefix -> ("bucket", "some/prefix") (no leading or trailing slash)."""
    if not is_obs(url):
        raise InputError(f"{url!r} is not an OBS address; write obs://<bucket>/<prefix>.")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise InputError(f"{url!r} names no bucket; write obs://<bucket>/<prefix>.")
    return bucket, prefix.strip("/")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/")] + [p.strip("/") for p in parts if p])


def _credentials() -> Tuple[str, str, Optional[str]]:
    for ak_name, sk_name in KEY_VARIABLES:
        ak, sk = os.environ.get(ak_name), os.environ.get(sk_name)
        if ak and sk:
            token = next((os.environ[t] for t in TOKEN_VARIABLES if os.environ.get(t)), None)
            return ak, sk, token
    names = " or ".join(f"{a}/{s}" for a, s in KEY_VARIABLES)
    raise MissingInputError(
        f"OBS needs credentials in the environment: set {names} (never in a file or notebook)."
    )


def timeout_s() -> float:
    """Seconds one OBS request may wait to connect or for each read: KIT_OBS_TIMEOUT_S, else TIMEOUT_S."""
    return seconds(os.environ, TIMEOUT_VARIABLE, TIMEOUT_S)


class _Guarded:
    """The SDK client, with what it raises (a refused or cut connection, a timeout) turned into one ObsError line
    that names the operation, the object and the endpoint."""

    def __init__(self, client, bucket: str, endpoint: str):
        self._client, self._bucket, self._endpoint = client, bucket, endpoint

    def __getattr__(self, name: str):
        call = getattr(self._client, name)

        def guarded(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except KitError:
                raise
            except Exception as exc:  # the SDK raises the socket's own errors
                key = args[1] if len(args) > 1 else kwargs.get("objectKey", kwargs.get("prefix") or "")
                raise ObsError(
                    f"OBS {name} obs://{self._bucket}/{key} at {self._endpoint} failed: {type(exc).__name__}: "
                    f"{exc or 'no answer'} (each request waits {timeout_s():g} s, tried {RETRIES + 1} times; "
                    f"{TIMEOUT_VARIABLE} sets the wait); check the endpoint and the network, then run it again."
                ) from None

        return guarded


class Store:
    """One bucket through the OBS SDK's ObsClient (made from the environment)."""

    def __init__(self, bucket: str, part_size: int = PART_SIZE, threads: int = THREADS):
        try:
            from obs import ObsClient
        except ImportError as exc:
            raise MissingInputError(
                f"OBS support needs the OBS SDK: pip install 'ascend-notebook-kit[obs]' (esdk-obs-python) ({exc})."
            ) from None
        endpoint = os.environ.get(ENDPOINT_VARIABLE)
        if not endpoint:
            raise MissingInputError(
                f"set {ENDPOINT_VARIABLE} to the OBS endpoint of the bucket's region, e.g. "
                f"https://obs.cn-southwest-2.myhuaweicloud.com."
            )
        signature = os.environ.get(SIGNATURE_VARIABLE, "obs").lower()
        if signature not in ("obs", "v4", "v2"):
            raise InputError(f"{SIGNATURE_VARIABLE}={signature!r} is not one of obs, v4, v2.")
        ak, sk, token = _credentials()
        host = endpoint.split("://")[-1].split(":")[0].split("/")[0]
        # a bucket named in the host needs DNS for it: an IP address or localhost gets path-style requests
        path_style = host == "localhost" or host.replace(".", "").isdigit()
        client = ObsClient(
            access_key_id=ak,
            secret_access_key=sk,
            security_token=token,
            server=endpoint,
            signature=signature,
            path_style=path_style,
            is_signature_negotiation=signature == "obs" and not path_style,
            timeout=timeout_s(),
            max_retry_count=RETRIES,
        )
        self.client = _Guarded(client, bucket, endpoint)
        self.bucket, self.part_size, self.threads = bucket, part_size, threads

    def _check(self, resp, what: str, key: str):
        if resp.status >= 300 and resp.errorCode == "NoSuchBucket":
            raise ObsError(
                f"OBS bucket {self.bucket!r} does not exist at {os.environ.get(ENDPOINT_VARIABLE)} (or is not this "
                f"account's): create it in the OBS console of that region, or fix the obs:// address."
            )
        if resp.status >= 300:
            raise ObsError(
                f"OBS {what} obs://{self.bucket}/{key} failed: HTTP {resp.status} {resp.errorCode or ''} "
                f"{resp.errorMessage or ''}".rstrip()
            )
        return resp

    def create_bucket(self) -> None:
        resp = self.client.createBucket(self.bucket)
        if resp.status >= 300 and resp.errorCode not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            self._check(resp, "create bucket", "")

    def list(self, prefix: str) -> Dict[str, int]:
        """{key: bytes} of every object under `prefix` (all pages)."""
        out, marker = {}, None
        while True:
            resp = self._check(
                self.client.listObjects(self.bucket, prefix=prefix, marker=marker, max_keys=1000),
                "list",
                prefix,
            )
            for obj in resp.body.contents:
                out[obj.key] = int(obj.size)
            if not resp.body.is_truncated or not resp.body.contents:
                return out
            marker = resp.body.next_marker or resp.body.contents[-1].key

    def put_file(self, key: str, path: Path, tries: int = 3) -> None:
        """Upload one file: the SDK's multipart, threaded upload; a cut upload resumes from its record (here up to
        `tries` times: a part that failed on a transient error is sent again, the others are kept)."""
        for attempt in range(tries):
            try:
                resp = self.client.uploadFile(
                    self.bucket,
                    key,
                    str(path),
                    partSize=self.part_size,
                    taskNum=self.threads,
                    enableCheckpoint=True,
                )
            except Exception as exc:  # the SDK raises when parts failed; its record keeps the others
                if attempt == tries - 1:
                    raise ObsError(f"OBS upload of obs://{self.bucket}/{key} failed: {exc}") from None
                continue
            self._check(resp, "upload of", key)
            return

    def put_bytes(self, key: str, data: bytes) -> None:
        self._check(self.client.putContent(self.bucket, key, data), "upload of", key)

    def put_new(self, key: str, data: bytes) -> bool:
        """Create the object only where none exists (`If-None-Match: *`); False where one does. A server that ignores
        the condition overwrites (kit.storage.obs_lease reads back); one that refuses it gets a plain put."""
        resp = self.client.putContent(self.bucket, key, data, extensionHeaders={"If-None-Match": "*"})
        # 412: the object exists; 409: S3's answer while another conditional put of the key is in flight
        if resp.status in (409, 412):
            return False
        if resp.status == 501:
            self.put_bytes(key, data)
            return True
        self._check(resp, "upload of", key)
        return True

    def get_bytes(self, key: str) -> Optional[bytes]:
        """The object's bytes, or None when it does not exist."""
        resp = self.client.getObject(self.bucket, key, loadStreamInMemory=True)
        if resp.status == 404 and resp.errorCode != "NoSuchBucket":
            return None
        return self._check(resp, "download of", key).body.buffer

    def delete(self, key: str) -> None:
        self._check(self.client.deleteObject(self.bucket, key), "delete of", key)


def store_for(url: str) -> Tuple[Store, str]:
    bucket, prefix = split(url)
    return Store(bucket), prefix


def local_files(folder: Path) -> list:
    """Relative names of the files under `folder`, sorted (the listing, temporaries and SDK records left out)."""
    folder = Path(folder)
    out = []
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if (
                name != LISTING
                and ".partial-" not in name
                and not name.startswith(".kit-")
                and not name.endswith(SDK_RECORDS)
            ):
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _folder_prefix(url: str, prefix: str) -> str:
    if not prefix:  # the listing and every file would sit at the bucket's root, among whatever else is there
        raise InputError(f"{url!r} names a bucket but no folder in it; write obs://<bucket>/<folder>.")
    return prefix


def upload_folder(folder: Path, url: str, store: Optional[Store] = None, overwrite: bool = False) -> dict:
    """Upload every file of `folder` under `url`, then its listing last (the folder is then complete in OBS), holding
    the prefix's writer lease (kit.storage.obs_lease) throughout.

    A complete upload already at `url` is replaced only with `overwrite` (its listing goes first, so the prefix is
    never complete with a mix of both); a missing or empty folder is an error, never an empty "complete" upload."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingInputError(f"{str(folder)!r} is not a folder; nothing was pushed to {url}.")
    names = local_files(folder)
    if not names:
        raise InputError(f"{str(folder)!r} holds no files; nothing was pushed to {url}.")
    store, prefix = (store, split(url)[1]) if store else store_for(url)
    prefix = _folder_prefix(url, prefix)
    # one writer per prefix: a second push gets one line
    with Lease(store, prefix, "obs push").take() as lease:
        if read_listing(store, prefix) is not None:
            if not overwrite:
                raise OutputExistsError(
                    f"{url} already holds a complete upload; push with --overwrite (overwrite=True) to replace it, "
                    f"or choose another folder."
                )
            store.delete(f"{prefix}/{LISTING}")
        listing = {}
        for rel in names:
            lease.check(read=False)  # the renewal saw another writer take over: stop here
            listing[rel] = crc32_file(folder / rel)
            store.put_file(f"{prefix}/{rel}", folder / rel)
        body = {"files": listing, "manifest_sha256": _manifest_sha256(folder)}
        lease.check()  # read back from OBS: a writer that lost its lease publishes nothing
        store.put_bytes(f"{prefix}/{LISTING}", (json.dumps(body, indent=1) + "\n").encode())
    return listing


def _manifest_sha256(folder: Path) -> Optional[str]:
    """The SHA-256 of the folder's manifest file (what later stages record as consumed), or None."""
    path = Path(folder) / MANIFEST_NAME
    return sha256_file(path) if path.is_file() else None


def read_listing(store: Store, prefix: str) -> Optional[dict]:
    raw = store.get_bytes(f"{prefix}/{LISTING}")
    return None if raw is None else json.loads(raw)


def _inside(dest: Path, files: Dict[str, dict], listing: str) -> None:
    """Refuse, before anything is written, a listed name that would land outside `dest`: absolute, with `..`, or
    through a link that points out (a listing anyone with write access to the prefix can edit)."""
    root = Path(os.path.abspath(dest))
    real = Path(os.path.realpath(root))
    for rel in files:
        parts = str(rel).replace("\\", "/").split("/")
        bad = not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in parts or "" in parts
        if not bad:
            target = Path(os.path.realpath(root / rel))
            bad = target != real and real not in target.parents
        if bad:
            raise InputError(
                f"{listing} names {rel!r}, which is not a file inside {str(root)!r}; nothing was downloaded. "
                f"Whoever can write to that OBS folder changed its listing: check it, and push the folder again."
            )


def download_files(store: Store, prefix: str, files: Dict[str, dict], dest: Path) -> list:
    """Fetch the listed files into `dest` (kept where size and CRC already match); return those OBS lacks.

    Parts of `store.part_size` in `store.threads` threads (kit.storage.obs_download: each byte CRC'd once, as it arrives);
    a file that does not match its listed size and CRC-32 is not left behind and is an IntegrityError."""
    from concurrent.futures import ThreadPoolExecutor

    from kit.errors import IntegrityError
    from kit.storage.obs_download import fetch

    dest = Path(dest)
    _inside(dest, files, f"obs://{store.bucket}/{prefix}/{LISTING}")
    present = store.list(prefix + "/")
    missing = []
    with ThreadPoolExecutor(max_workers=max(1, store.threads), thread_name_prefix="kit-obs-get") as pool:
        for rel, want in sorted(files.items()):
            path, key = dest / rel, f"{prefix}/{rel}"
            if path.is_file() and path.stat().st_size == want["bytes"] and crc32_file(path) == want:
                continue  # already here (an earlier, interrupted download got this far)
            if key not in present:
                missing.append(rel)
                continue
            if present[key] != want["bytes"] or not fetch(store, key, path, want, pool):
                path.unlink(missing_ok=True)
                raise IntegrityError(
                    f"obs://{store.bucket}/{key} does not match its size/CRC-32 in {LISTING}; upload it again."
                )
    return missing


def download_folder(url: str, dest: Path, timeout_s: float = 0.0) -> Path:
    """A folder uploaded by upload_folder() into `dest`, resumably, verified against the listing's CRCs and its
    manifest's SHA-256 (kit.core.manifest); MissingInputError if the upload is incomplete.

    `timeout_s`: wait up to that long for the listing (another node may still be uploading)."""
    store, prefix = store_for(url)
    prefix = _folder_prefix(url, prefix)
    deadline = time.monotonic() + timeout_s
    listing = read_listing(store, prefix)
    while listing is None and time.monotonic() < deadline:
        time.sleep(1.0)
        listing = read_listing(store, prefix)
    if listing is None:
        raise MissingInputError(
            f"{url} is not a complete kit upload (no {LISTING}); upload the folder with "
            f"`python -m kit obs push FOLDER {url}`."
        )
    missing = download_files(store, prefix, listing["files"], dest)
    if missing:
        raise MissingInputError(f"{url} lacks {len(missing)} listed file(s): {', '.join(missing[:5])}.")
    want = listing.get("manifest_sha256")
    if want and _manifest_sha256(Path(dest)) != want:
        from kit.errors import IntegrityError

        raise IntegrityError(f"{dest}: its kit manifest is not the one uploaded to {url} (sha256 differs).")
    return Path(dest)


def pull(url: str, dest: Path, overwrite: bool = False) -> Path:
    """`obs pull`: the upload at `url` as the folder `dest`, which appears only when it is complete and verified.

    It is written in `.<dest>.partial-obs` beside it (a cut pull resumes there) and renamed; an existing `dest` is
    replaced only with `overwrite`, and only once the new copy is complete."""
    from kit.storage.locks import hold

    dest = Path(os.path.abspath(dest))
    with hold(dest, "OBS pull"):
        if dest.exists() and not overwrite:
            raise OutputExistsError(
                f"{str(dest)!r} exists; pull with --overwrite to replace it, or choose another folder."
            )
        work = dest.with_name(f".{dest.name}.partial-obs")
        download_folder(url, work)
        if dest.exists():
            import shutil

            aside = dest.with_name(f".{dest.name}.replaced-obs")
            os.replace(dest, aside)
            os.replace(work, dest)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(work, dest)
    return dest


def register(sub) -> None:
    """`python -m kit obs push FOLDER obs://...` / `pull obs://... FOLDER` (credentials from the environment)."""
    p = sub.add_parser(
        "obs", help="copy a stage's folder to or from OBS (complete only with its listing, verified)"
    )
    ops = p.add_subparsers(dest="op", required=True)
    push = ops.add_parser("push", help="upload FOLDER to URL, its listing last")
    push.add_argument("folder")
    push.add_argument("url")
    push.add_argument("--overwrite", action="store_true", help="replace a complete upload at URL")
    push.set_defaults(
        func=lambda a: print(
            f"uploaded {len(upload_folder(Path(a.folder), a.url, overwrite=a.overwrite))} files to {a.url}"
        )
    )
    get = ops.add_parser(
        "pull", help="download URL as FOLDER (it appears complete and verified, or not at all)"
    )
    get.add_argument("url")
    get.add_argument("folder")
    get.add_argument("--overwrite", action="store_true", help="replace FOLDER once the new copy is complete")
    get.set_defaults(
        func=lambda a: print(f"downloaded {a.url} into {pull(a.url, Path(a.folder), overwrite=a.overwrite)}")
    )
