"""Images in and out of a pipeline, the way diffusers does it, and images written atomically in the format their name says.

Preprocessing is diffusers' own :class:`~diffusers.image_processor.VaeImageProcessor` (not
re-implemented), so the pixels are the torch pipeline's:

* the VAE's output [-1, 1] NCHW -> denormalize to [0, 1] -> NHWC float (``postprocess``), and to
  uint8 as ``numpy_to_pil`` rounds: ``(x * 255).round()``. ``postprocess`` is the processor's
  arithmetic in NumPy, bit for bit (a test compares them): the processor took 12-20 ms of the
  H100 host's time per image (its construction and torch's CPU ops), NumPy takes about 1 ms;
* the image written in the format its file name's suffix names (Pillow's formats), atomically;
* a ControlNet image -> RGB -> resized (lanczos) to the requested size, rounded down to a multiple
  of the VAE factor -> [0, 1] NCHW float32, *not* normalized to [-1, 1] (``do_normalize=False``).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from onnxopt.errors import MissingDependencyError, OnnxoptError
from onnxopt.input_files import refuse_special_file
from onnxopt.outputs import Outputs, umask


def vae_processor(vae_scale_factor: int, **options):
    """diffusers' VaeImageProcessor with ``options`` (its pipelines' own preprocessing)."""
    try:
        from diffusers.image_processor import VaeImageProcessor
    except ImportError as exc:
        raise MissingDependencyError("generating images needs diffusers: pip install 'onnxopt[pipeline]'") from exc
    return VaeImageProcessor(vae_scale_factor=vae_scale_factor, **options)


def postprocess(decoded: np.ndarray, vae_scale_factor: int = 8) -> np.ndarray:
    """VAE output [B, 3, H, W] in [-1, 1] -> [B, H, W, 3] float32 in [0, 1]: diffusers' output_type="np",
    ``(x * 0.5 + 0.5).clamp(0, 1)`` then NCHW -> NHWC, in float32 as torch computes it."""
    x = np.array(decoded, np.float32)  # one copy, then in place: each new 3 MB array costs page faults on the host
    np.multiply(x, np.float32(0.5), out=x)
    np.add(x, np.float32(0.5), out=x)
    np.clip(x, np.float32(0), np.float32(1), out=x)
    return x.transpose(0, 2, 3, 1)


def to_pil(pixels: np.ndarray):
    """[H, W, 3] float in [0, 1] -> a PIL image, rounded as diffusers' numpy_to_pil rounds."""
    from PIL import Image

    return Image.fromarray((pixels * 255).round().astype("uint8"))


def check_image(path) -> None:
    """Read only ``path``'s header: a one-line error, before any work, when it is not an image or
    declares too many pixels (see :func:`load_image`)."""
    load_image(path, header_only=True)


def load_image(path, header_only: bool = False):
    """A PIL image from a file, as RGB and upright, as diffusers' ``load_image`` reads it: turned as its
    EXIF orientation says (a phone's photo is stored sideways, with the turn in its EXIF); a
    one-line error when it is not a readable image."""
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError as exc:
        raise MissingDependencyError("generating images needs Pillow: pip install 'onnxopt[pipeline]'") from exc
    refuse_special_file(path, "an image")
    try:
        with warnings.catch_warnings():
            # PIL warns above MAX_IMAGE_PIXELS and raises above twice that: both refused, before any pixel is decoded
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                return None if header_only else ImageOps.exif_transpose(image).convert("RGB")
    except FileNotFoundError:
        raise OnnxoptError(f"{path}: no such image")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise OnnxoptError(f"{path}: the image declares more pixels than an input image may have "
                           f"({exc.args[0].split('(')[0].strip() if exc.args else 'too large'})")
    except (OSError, UnidentifiedImageError) as exc:
        raise OnnxoptError(f"{path}: not a readable image: {exc}")


def preprocess_control_image(image, height: int | None, width: int | None, vae_scale_factor: int = 8) -> np.ndarray:
    """A ControlNet conditioning image -> [1, 3, H, W] float32 in [0, 1], as StableDiffusionControlNetPipeline does."""
    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    processor = vae_processor(vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    size = processor.get_default_height_width(image, height, width)  # the image's own size, rounded down
    if min(size) <= 0:  # a 1x1 image: diffusers' "height and width must be > 0" deep in the resize (exit 3)
        raise OnnxoptError(f"the conditioning image is smaller than {vae_scale_factor} pixels on a side: give a larger "
                           "image, or --height and --width")
    return processor.preprocess(image, height=height, width=width).to(dtype=__import__("torch").float32).numpy()


def check_writable(path) -> None:
    """Fail before any work when the image cannot be written there (:class:`onnxopt.outputs.Outputs`)."""
    Outputs().file(path)


def image_format(path) -> str:
    """The PIL format ``path``'s suffix names (.png PNG, .jpg/.jpeg JPEG, .webp WEBP...), or a one-line
    error for a suffix PIL cannot write (checked before the work: the bytes must be what the name says)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise MissingDependencyError("generating images needs Pillow: pip install 'onnxopt[pipeline]'") from exc
    Image.init()
    suffix = Path(path).suffix.lower()
    writable = {ext: fmt for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}
    if suffix not in writable:
        raise OnnxoptError(f"{path}: {'unknown image format ' + repr(suffix) if suffix else 'no image suffix'}: "
                           f"name the file .png, .jpg or .webp (or another format Pillow writes)")
    return writable[suffix]


def write_image(image, path) -> Path:
    """Write a PIL image in the format its suffix names (:func:`image_format`), atomically: a
    temporary file beside ``path``, renamed into place."""
    path = Path(path)
    check_writable(path)
    fmt = image_format(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600 files; an image follows the umask
        with os.fdopen(fd, "wb") as out:
            image.save(out, format=fmt)
        os.replace(tmp, path)
    except OSError as exc:
        raise OnnxoptError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
