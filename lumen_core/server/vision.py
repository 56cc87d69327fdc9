"""Images in chat requests (issue 17), shared by both APIs once their content parts are converted.

Each route turns its API's image parts (OpenAI ``image_url``, Anthropic ``image`` blocks) into the engine's part
``{"type": "image", "image": SOURCE}`` in place, between the text parts, and records an ``ImageRef`` per image: the
request field that holds it (for error messages), the part, and the URL to fetch when it is one. Then, before
anything is queued, ``load_images``:

1. refuses images where the engine has no vision tower (``("vision", None)`` not among its backends): a 400 with
   the engine's own message, which says how to load one (a ``vision`` block in the server's config) — whoever runs
   the server can fix it, the client cannot;
2. refuses more than ``Limits.max_images`` images;
3. fetches the URLs, all at once, each on a thread within ``Limits.fetch_timeout`` and ``Limits.fetch_max_bytes``
   (``fetch.py``); the bytes replace the URL in the part, so the generation does not fetch again;
4. decodes each image (``lumen_core.images.load_image``, labelled with its field: a bad, truncated, oversized or
   decompression-bomb image is a 400 naming the field and the loader's reason) and preprocesses them for the
   model (``Engine.images_in``), off the event loop.

The preprocessed images give the prompt's true length: ``expand`` widens each placeholder the template wrote into
the image's tokens (``Architecture.expand_image_tokens``) without running the tower, so the context check,
``max_tokens`` check, ``usage`` and ``count_tokens`` count the image tokens. The decoded images are not kept: the
queued generation holds the encoded bytes (or data URIs) and ``Engine.chat`` decodes them again on the worker,
which costs little beside the tower and keeps a queued request's memory at its encoded size.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from ..errors import InputError
from ..images import load_image
from .app import APIError
from .fetch import FetchError, check_url, fetch_image

NO_VISION = "this model takes no images"


@dataclass
class ImageRef:
    field: str  # the request field that holds the image, e.g. messages[0].content[1].image_url.url
    part: dict  # the engine's part {"type": "image", "image": SOURCE}; a URL's bytes replace SOURCE once fetched
    url: str | None = None  # an http(s) URL to fetch

    @property
    def label(self) -> str:
        return f"{self.field} ({self.url})" if self.url else self.field


def image_part(source, field: str, refs: list[ImageRef], url: str | None = None) -> dict:
    """The engine's image part for ``source`` (bytes or a data URI; a URL is fetched later), recorded in ``refs``."""
    part = {"type": "image", "image": source}
    refs.append(ImageRef(field, part, url))
    return part


def url_part(url: str, field: str, refs: list[ImageRef], param: str | None = None) -> dict:
    """The part of an http(s) URL (fetched by ``load_images``); another scheme is a 400 naming ``field``."""
    try:
        check_url(url)
    except FetchError as exc:
        raise APIError(400, f"{field}: {exc.reason}", param=param) from None
    return image_part(url, field, refs, url)


def require_vision(engine, n: int, param: str | None = "messages") -> None:
    """A 400 unless the engine has its vision tower loaded; the message is the engine's (how to load one)."""
    if ("vision", None) in getattr(engine, "backends", {}):
        return
    message = f"{NO_VISION}: no vision tower is loaded"
    try:
        engine.images_in([b""] * n)  # raises its "no vision tower loaded ..." before reading any image
    except InputError as exc:
        message = str(exc)
    raise APIError(400, message, param=param)


async def load_images(app, refs: list[ImageRef], param: str | None = "messages") -> list:
    """The request's images checked, fetched, decoded and preprocessed (``ImageInput``, in prompt order), or a 400
    naming the field; [] without images."""
    if not refs:
        return []
    engine, limits = app.state.engine, app.state.limits
    require_vision(engine, len(refs), param)
    if len(refs) > limits.max_images:
        raise APIError(400, f"the request holds {len(refs)} images; this server takes at most {limits.max_images} "
                       "per request", param=param)
    fetching = [ref for ref in refs if ref.url is not None and isinstance(ref.part["image"], str)]
    if fetching and not limits.fetch_urls:
        raise APIError(400, f"{fetching[0].field}: this server does not fetch image URLs (server-parameters."
                       "fetch-image-urls is false); send the image inline (a data: URI, or base64)", param=param)
    if fetching:
        bodies = await asyncio.gather(*(run_in_threadpool(fetch_image, ref.url, limits.fetch_timeout,
                                                          limits.fetch_max_bytes) for ref in fetching),
                                      return_exceptions=True)
        for ref, body in zip(fetching, bodies, strict=True):
            if isinstance(body, FetchError):
                raise APIError(400, f"{ref.field}: {body}", param=param)
            if isinstance(body, BaseException):
                raise body
            ref.part["image"] = body
    try:
        return await run_in_threadpool(_decode, engine, refs)
    except InputError as exc:
        raise APIError(400, str(exc), param=param) from None


def _decode(engine, refs: list[ImageRef]) -> list:
    images = [load_image(ref.part["image"], label=ref.label) for ref in refs]
    return engine.images_in(images)  # decoded images pass through its loader as they are


def expand(engine, ids: list[int], images: list, param: str | None = "messages") -> list[int]:
    """The prompt ``ids`` with each image placeholder widened to its image's tokens (the tower is not run)."""
    if not images:
        return ids
    try:
        return engine.arch.expand_image_tokens(list(ids), images)
    except InputError as exc:
        raise APIError(400, f"{exc}. This model's chat template did not write a placeholder for every image "
                       "(it may take images only in user messages)", param=param) from None
