"""Signature Version 4 as AWS documents it, and the store's address from the AWS variables."""

from __future__ import annotations

import datetime

import pytest

from engramd.sources.s3api import StoreAccess, sign

#: The example keys of AWS's Signature Version 4 documentation (Amazon S3, "Examples of
#: signature calculations"), whose requests' signatures it gives.
EXAMPLE = StoreAccess(
    "examplebucket",
    "",
    access_key="AKIAIOSFODNN7EXAMPLE",
    secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
)
WHEN = datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC)
HOST = "examplebucket.s3.amazonaws.com"


@pytest.mark.parametrize(
    ("path", "query", "extra", "signed", "signature"),
    [
        (
            "/test.txt",
            {},
            {"Range": "bytes=0-9"},
            "host;range;x-amz-content-sha256;x-amz-date",
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
        ),
        (
            "/",
            {"max-keys": "2", "prefix": "J"},
            {},
            "host;x-amz-content-sha256;x-amz-date",
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
        ),
    ],
)
def test_requests_are_signed_as_aws_documents(
    path: str, query: dict[str, str], extra: dict[str, str], signed: str, signature: str
) -> None:
    """A ranged GET of an object and a listing, signed: AWS's published signatures."""
    headers = sign("GET", HOST, path, query, extra, EXAMPLE, WHEN)
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    assert headers["x-amz-date"] == "20130524T000000Z"


def test_without_keys_nothing_is_signed() -> None:
    """A public bucket: the request carries no signature (and no date to sign)."""
    headers = sign("GET", HOST, "/x", {}, {}, StoreAccess("examplebucket", ""), WHEN)
    assert headers == {"host": HOST}


def test_the_store_is_read_from_the_aws_variables() -> None:
    """Endpoint (S3's own first), region and keys as the AWS tools take them; path-style
    addresses behind an endpoint; a URL that is no s3://bucket/prefix names the flag."""
    access = StoreAccess.of(
        "s3://tables/models/engram/",
        {
            "AWS_ENDPOINT_URL": "http://other:1",
            "AWS_ENDPOINT_URL_S3": "http://minio:9000",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "secret",
        },
        "--checkpoint",
    )
    assert (access.url, access.key("a.safetensors")) == (
        "s3://tables/models/engram",
        "models/engram/a.safetensors",
    )
    assert access.nixl_params(4) == {
        "bucket": "tables",
        "num_threads": "4",
        "region": "eu-west-1",
        "endpoint_override": "http://minio:9000",
        "scheme": "http",
        "use_virtual_addressing": "false",
        "access_key": "id",
        "secret_key": "secret",
    }
    with pytest.raises(ValueError, match="--checkpoint 'gs://b/p' is not s3://bucket/prefix"):
        StoreAccess.of("gs://b/p", {}, "--checkpoint")
