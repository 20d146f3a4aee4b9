"""The ``fsspec`` source per backend, without a server: which listing field is each backend's change
signal (the info dicts are as s3fs, gcsfs, adlfs and sshfs return them from ``find(detail=True)``),
which storage options count as credentials, and what an SFTP URL gives the backend."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from ragline.flows.sources.fsspec import FsspecSource, FsspecSpec, _signal

WHEN = datetime(2026, 11, 24, 18, 58, 7, 534301, tzinfo=timezone.utc)
LATER = datetime(2026, 11, 24, 19, 0, 0, tzinfo=timezone.utc)


def test_s3_signal_is_the_etag():
    info = {"ETag": '"5d41402abc4b2a76b9719d911017c592"', "LastModified": WHEN, "size": 5, "type": "file"}
    assert _signal(info, "s3") == 'ETag:"5d41402abc4b2a76b9719d911017c592"'
    assert _signal({**info, "LastModified": LATER}, "s3") == _signal(info, "s3")  # touched, same bytes


def gcs_info(generation: str, metageneration: str, etag: str, updated: datetime = WHEN) -> dict:
    return {"name": "docs/handbook/a.md", "bucket": "docs", "size": 5, "type": "file", "generation": generation,
            "metageneration": metageneration, "etag": etag, "md5Hash": "XUFAKrxLKna5cZ2REBfFkg==",
            "crc32c": "mnG7TA==", "mtime": updated, "updated": updated.isoformat()}


def test_gcs_signal_is_the_generation_which_a_metadata_update_keeps():
    written = gcs_info("1795546687534794", "1", "CMqF1tGGuo8DEAE=")
    relabelled = gcs_info("1795546687534794", "2", "CMqF1tGGuo8DEAI=", updated=LATER)  # metadata patched
    rewritten = gcs_info("1795546687602720", "1", "CKCp2tGGuo8DEAE=", updated=LATER)
    assert _signal(written, "gs") == "generation:1795546687534794" == _signal(relabelled, "gs")
    assert _signal(rewritten, "gs") != _signal(written, "gs")
    assert _signal(written, "gcs") == _signal(written, "gs")


def azure_info(etag: str, modified: datetime = WHEN) -> dict:
    return {"name": "docs/handbook/a.md", "size": 5, "type": "file", "etag": etag, "last_modified": modified,
            "creation_time": WHEN, "version_id": None, "metadata": {"is_directory": "false"},
            "content_settings": {"content_type": "application/octet-stream", "content_md5": bytearray(b"]A@*")}}


def test_azure_signal_is_the_blob_etag():
    assert _signal(azure_info('"0x2798CA7F4A75A40"'), "az") == 'etag:"0x2798CA7F4A75A40"'
    # Azure stamps last_modified in whole seconds: a rewrite within the second still moves the ETag
    assert _signal(azure_info('"0x1F59C7C2F541220"'), "az") != _signal(azure_info('"0x2798CA7F4A75A40"'), "az")
    assert _signal(azure_info('"0x2798CA7F4A75A40"'), "abfs") == _signal(azure_info('"0x2798CA7F4A75A40"'), "az")


def sftp_info(size: int, mtime: datetime) -> dict:
    return {"name": "/srv/docs/a.md", "size": size, "type": "file", "gid": 0, "uid": 0, "permissions": 0o100644,
            "time": LATER, "mtime": mtime}


def test_sftp_signal_is_size_and_mtime_and_ignores_the_access_time():
    signal = _signal(sftp_info(5, WHEN), "sftp")
    assert signal == f"size:5:{WHEN.timestamp()}"
    assert _signal({**sftp_info(5, WHEN), "time": WHEN}, "sftp") == signal  # read again: atime moved
    assert _signal(sftp_info(6, WHEN), "sftp") != signal and _signal(sftp_info(5, LATER), "sftp") != signal
    assert _signal(sftp_info(5, WHEN), "ssh") == signal


def test_an_unnamed_backend_takes_the_first_version_field_else_size_and_mtime():
    assert _signal({"etag": "abc", "size": 1, "mtime": 3.0}, "webdav") == "etag:abc"
    assert _signal({"size": 1, "mtime": 3.0}, "webdav") == "size:1:3.0"
    assert _signal({"size": 1}, "webdav") is None  # nothing cheap: always downloaded


def spec(**fields) -> FsspecSpec:
    return FsspecSpec(type="fsspec", **fields)


@pytest.mark.parametrize("option", ["connection_string", "account_key", "sas_token", "client_secret", "passphrase",
                                    "password", "token"])
def test_credential_options_of_each_backend_are_refused(option):
    with pytest.raises(ValidationError, match=f"option '{option}' looks like a credential"):
        spec(url="az://docs/", options={option: "DefaultEndpointsProtocol=https;AccountKey=c2VjcmV0"})


def test_a_gcs_token_that_names_a_method_is_not_a_credential():
    assert spec(url="gs://docs/", options={"token": "anon"}).options == {"token": "anon"}
    with pytest.raises(ValidationError, match="looks like a credential"):
        spec(url="gs://docs/", options={"token": "ya29.a0AfH6SMBx"})


def test_an_sftp_url_gives_host_port_and_user_and_host_keys_are_checked_by_default():
    sshfs = pytest.importorskip("sshfs")
    s3fs = pytest.importorskip("s3fs")
    assert FsspecSource(spec(url="s3://b/p/", concurrency=4), max_bytes=1)._options(s3fs.S3FileSystem) == \
        {"use_listings_cache": False}
    source = FsspecSource(spec(url="sftp://reader@127.0.0.1:2222/srv/docs/"), max_bytes=1000)
    assert source._options(sshfs.SSHFileSystem) == {"host": "127.0.0.1", "port": 2222, "username": "reader",
                                                    "known_hosts": ()}
    chosen = FsspecSource(spec(url="sftp://h/srv/", options={"known_hosts": "/etc/ragline/known_hosts", "port": 22}),
                          max_bytes=1000)
    assert chosen._options(sshfs.SSHFileSystem) == {"host": "h", "port": 22, "known_hosts": "/etc/ragline/known_hosts"}


def test_s3_keeps_as_many_connections_as_objects_fetched_at_once_unless_told():
    s3fs = pytest.importorskip("s3fs")
    options = FsspecSource(spec(url="s3://b/p/", options={"config_kwargs": {"retries": {"max_attempts": 1}}}),
                           max_bytes=1)._options(s3fs.S3FileSystem)
    assert options["config_kwargs"] == {"retries": {"max_attempts": 1}, "max_pool_connections": 16}
    chosen = spec(url="s3://b/p/", concurrency=32, options={"config_kwargs": {"max_pool_connections": 50}})
    assert FsspecSource(chosen, max_bytes=1)._options(s3fs.S3FileSystem)["config_kwargs"] == \
        {"max_pool_connections": 50}
