//! ImageDecoder (opset 20): decodes an encoded image byte stream into an `[H, W, C]` uint8
//! tensor with the `image` crate.

use image::{DynamicImage, ImageReader};
use npuc_ir::{DType, Tensor};
use npuc_runtime::bail;
use npuc_runtime::Result;
use npuc_runtime::Value;
use npuc_runtime::{Inputs, OpCtx, Registry};
use std::io::Cursor;

pub fn register(r: &mut Registry) {
    r.add("ImageDecoder", 20, image_decoder);
}

/// Output channel layout requested by `pixel_format`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PixelFormat {
    Rgb,
    Bgr,
    Grayscale,
}

/// Luma of an RGB pixel with the ITU-R 601-2 weights in the 16-bit fixed point Pillow uses
/// for `convert("L")` (the reference implementation's grayscale path), rounded to nearest.
#[inline]
fn luma601(r: u8, g: u8, b: u8) -> u8 {
    ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16) as u8
}

/// ImageDecoder: decodes the 1-D uint8 `encoded_stream` (format detected from its content:
/// PNG, BMP, PNM, TIFF, WebP, JPEG) into `[H, W, 3]` RGB or BGR, or `[H, W, 1]` grayscale.
/// Alpha channels are dropped; gray images are replicated to three channels for RGB/BGR.
/// Images with more than 8 bits per channel are reduced to 8 bits.
fn image_decoder(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    if x.dtype() != DType::U8 || x.rank() != 1 {
        bail!(
            "encoded_stream must be a 1-D uint8 tensor, got {} {:?}",
            x.dtype(),
            x.shape()
        );
    }
    let fmt = match ctx.node.str_or("pixel_format", "RGB")? {
        "RGB" => PixelFormat::Rgb,
        "BGR" => PixelFormat::Bgr,
        "Grayscale" => PixelFormat::Grayscale,
        other => bail!("pixel_format must be RGB, BGR or Grayscale, got '{other}'"),
    };
    let bytes = x.as_slice::<u8>()?;
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| npuc_runtime::RtError::msg(format!("cannot read the image: {e}")))?;
    if reader.format().is_none() {
        bail!("unrecognised or unsupported image format");
    }
    let img = reader
        .decode()
        .map_err(|e| npuc_runtime::RtError::msg(format!("cannot decode the image: {e}")))?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    let t = match fmt {
        PixelFormat::Grayscale => {
            let data = match img {
                // Already gray: Pillow's convert("L") keeps the values.
                DynamicImage::ImageLuma8(g) => g.into_raw(),
                other => other
                    .to_rgb8()
                    .pixels()
                    .map(|p| luma601(p[0], p[1], p[2]))
                    .collect(),
            };
            Tensor::from_vec(vec![h, w, 1], data)?
        }
        PixelFormat::Rgb | PixelFormat::Bgr => {
            let mut data = img.to_rgb8().into_raw();
            if fmt == PixelFormat::Bgr {
                for px in data.chunks_exact_mut(3) {
                    px.swap(0, 2);
                }
            }
            Tensor::from_vec(vec![h, w, 3], data)?
        }
    };
    Ok(vec![Value::tensor(t)])
}
