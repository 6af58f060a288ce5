//! The provider's own token rules for the media a prompt carries, and the sizes those
//! rules need, read from each file's header.
//!
//! A reservation must be a worst case and no more. Counting an image as its base64 text
//! (bytes / 4) reserves a 1024x1024 PNG sent as 4 MB of base64 as a million tokens, when
//! Claude bills it about 1,400. So [`sniff`] reads the width and height from the header (PNG
//! `IHDR`, GIF logical screen, WebP `VP8 `/`VP8L`/`VP8X`, JPEG start of frame, BMP) or
//! counts a PDF's pages, decoding only as much of the base64 as that takes and never the
//! pixels, and the functions below turn that size into tokens the way each provider
//! documents it. Where the published rule changed between versions of a page, or is
//! silent, the larger figure is used, so an estimate errs towards reserving too much.
//!
//! Sources (read in 2026; re-check them when a provider ships new models):
//! - Anthropic, *Vision*, "Evaluate image size"
//!   (<https://platform.claude.com/docs/en/build-with-claude/vision>, formerly
//!   docs.anthropic.com): an image costs about `width * height / 750` tokens, and one whose
//!   long edge is over 1568 px or that would cost more than about 1,600 tokens is first
//!   scaled down, keeping its aspect ratio (1092x1092 is ~1,590 tokens). The current page
//!   counts 28x28 px patches instead (`ceil(w/28) * ceil(h/28)` visual tokens) in two
//!   tiers: 1568 px and 1,568 visual tokens, and, for Claude 4.7 and later, 2576 px and
//!   4,784 visual tokens (also the models' migration guide, "Images").
//!   [`anthropic_image_tokens`] charges the larger of the two counts.
//! - Anthropic, *PDF support*, "Estimate your costs"
//!   (<https://platform.claude.com/docs/en/build-with-claude/pdf-support>): a page
//!   "typically uses 1,500-3,000 tokens" of text, and since each page is also converted
//!   into an image, the image rule applies to it as well.
//! - OpenAI, *Images and vision*, "Calculating costs"
//!   (<https://developers.openai.com/api/docs/guides/images-vision>, formerly
//!   platform.openai.com/docs/guides/images-vision): the tile rule (fit in 2048x2048, bring
//!   the shortest side down to 768, count 512 px tiles; base + per-tile tokens, or base
//!   alone at `low`), the patch rule (32x32 px patches within a per-detail pixel limit and
//!   patch budget, times a per-model multiplier, rounded up), and the "Model sizing
//!   behavior" table saying which model uses which limits. The figures per model are in
//!   `OPENAI_RULES`, with where the page's versions disagree.
//!
//! Everything here is pure: no I/O, no allocation of a decoded file, and no panic on any
//! input; damaged or unrecognised data is [`MediaSize::Unknown`], which the caller prices
//! at the most such media can cost. The decoding is the `base64` and `flate2` crates',
//! read as streams and only as far as a size needs.

use std::cmp::{max, min};
use std::io::{self, BufRead, BufReader, Read};

use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::read::DecoderReader;
use flate2::{Decompress, FlushDecompress, Status};

/// What [`sniff`] could read about a file from its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MediaSize {
    /// A raster image of this many pixels.
    Image { width: u32, height: u32 },
    /// A PDF of this many pages.
    Pdf { pages: u32 },
    /// Not a format we read, damaged, or without a size we could find.
    Unknown,
}

/// Splits a `data:<media type>[;params];base64,<payload>` URL into its media type and payload.
///
/// An empty media type is `text/plain`, as RFC 2397 says; a data URL that is not base64 is
/// `None`, since nothing here reads percent-encoded bytes.
pub fn data_url_payload(url: &str) -> Option<(&str, &str)> {
    let url = url.trim_start();
    let rest = url
        .get(..5)
        .filter(|scheme| scheme.eq_ignore_ascii_case("data:"))
        .and_then(|_| url.get(5..))?;
    let (meta, payload) = rest.split_once(',')?;
    let (params, last) = meta.rsplit_once(';')?;
    if !last.trim().eq_ignore_ascii_case("base64") {
        return None;
    }
    let media_type = params.split(';').next().unwrap_or("").trim();
    Some((
        if media_type.is_empty() {
            "text/plain"
        } else {
            media_type
        },
        payload,
    ))
}

/// Reads an image's size or a PDF's page count from base64 data, decoding only what it needs.
///
/// Takes the bare payload (a `data:` URL is also accepted); whitespace and line breaks are
/// skipped and padding is optional. A zero width, height or page count is `Unknown`.
pub fn sniff(base64: &str) -> MediaSize {
    let payload = data_url_payload(base64).map_or(base64, |(_, payload)| payload);
    // A decoding error ends the data: what was read before it is kept.
    let mut head = Vec::with_capacity(32);
    let _ = decode(payload).take(32).read_to_end(&mut head);
    let head = &head[..];
    let found = if head.starts_with(&PNG_SIGNATURE) {
        png(head)
    } else if head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a") {
        gif(head)
    } else if head.starts_with(b"RIFF") && head.get(8..12) == Some(b"WEBP".as_slice()) {
        webp(head)
    } else if head.starts_with(&[0xFF, 0xD8]) {
        jpeg(decode(payload))
    } else if head.starts_with(b"BM") {
        bmp(head)
    } else {
        pdf(payload, PDF_INFLATE_BUDGET)
    };
    match found {
        Some(MediaSize::Image { width, height }) if width > 0 && height > 0 => {
            MediaSize::Image { width, height }
        }
        Some(MediaSize::Pdf { pages }) if pages > 0 => MediaSize::Pdf { pages },
        _ => MediaSize::Unknown,
    }
}

// ---------------------------------------------------------------------------------------
// Base64, decoded as a stream
// ---------------------------------------------------------------------------------------

/// The standard alphabet, with padding optional (the end of the data is where [`Text`]
/// stops) and the unused bits of the last character not checked: they hold no data.
static BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

type Decoder<'a> = DecoderReader<'static, GeneralPurpose, Text<'a>>;

/// Decodes `payload` on demand, under a kilobyte at a time, so reading a header costs the
/// same however large the file.
fn decode(payload: &str) -> Decoder<'_> {
    DecoderReader::new(Text(payload.as_bytes()), &BASE64)
}

/// A payload's base64 characters, without the whitespace line-wrapping encoders put in.
///
/// Padding, or any byte outside the alphabet, ends the data: what follows padding is not
/// ours to read, and the decoder would fail the whole read that met a stray byte, losing
/// the bytes decoded before it. So damaged data reads as a short file, sized as `Unknown`
/// or, for a PDF, counted as far as it goes.
struct Text<'a>(&'a [u8]);

impl Read for Text<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut n = 0;
        while n < out.len() && !self.0.is_empty() {
            // Runs of characters are copied whole: whitespace is rare (MIME breaks lines
            // every 76), and a byte at a time is most of the decoding's cost.
            let room = min(self.0.len(), out.len() - n);
            let run = self.0[..room].iter().position(|&b| !is_base64(b));
            let run = run.unwrap_or(room);
            out[n..n + run].copy_from_slice(&self.0[..run]);
            n += run;
            self.0 = &self.0[run..];
            match self.0.first() {
                Some(b' ' | b'\t' | b'\r' | b'\n' | 0x0C) => self.0 = &self.0[1..],
                Some(_) if run < room => self.0 = &[],
                _ => {}
            }
        }
        Ok(n)
    }
}

/// Whether `b` is in the standard alphabet. This runs on every byte of a PDF, so the
/// `matches!` is made into a bit set once: comparing ranges byte by byte took half the
/// time a large PDF takes.
fn is_base64(b: u8) -> bool {
    const SET: u128 = {
        let (mut set, mut b) = (0u128, 0u8);
        while b < 128 {
            if matches!(b, b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/') {
                set |= 1 << b;
            }
            b += 1;
        }
        set
    };
    b < 128 && SET >> b & 1 == 1
}

// ---------------------------------------------------------------------------------------
// Image headers
// ---------------------------------------------------------------------------------------

const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];

/// The little-endian unsigned integer of `len` (at most 4) bytes at `at`.
fn le(b: &[u8], at: usize, len: usize) -> Option<u32> {
    let bytes = b.get(at..at.checked_add(len)?)?;
    Some(bytes.iter().rev().fold(0, |n, &b| n << 8 | u32::from(b)))
}

/// The big-endian unsigned integer of `len` (at most 4) bytes at `at`.
fn be(b: &[u8], at: usize, len: usize) -> Option<u32> {
    let bytes = b.get(at..at.checked_add(len)?)?;
    Some(bytes.iter().fold(0, |n, &b| n << 8 | u32::from(b)))
}

fn image(width: u32, height: u32) -> Option<MediaSize> {
    Some(MediaSize::Image { width, height })
}

/// PNG: the spec puts `IHDR` (13 bytes of data) first, width then height, big-endian.
fn png(head: &[u8]) -> Option<MediaSize> {
    if be(head, 8, 4)? != 13 || head.get(12..16)? != b"IHDR" {
        return None;
    }
    let (width, height) = (be(head, 16, 4)?, be(head, 20, 4)?);
    // The spec caps both at 2^31 - 1; larger is a damaged header, not a huge image.
    if width > i32::MAX as u32 || height > i32::MAX as u32 {
        return None;
    }
    image(width, height)
}

/// GIF: the logical screen is the canvas every frame is drawn on, so it is what is sent.
fn gif(head: &[u8]) -> Option<MediaSize> {
    image(le(head, 6, 2)?, le(head, 8, 2)?)
}

/// WebP: the first chunk after `RIFF....WEBP` says which of the three bitstreams it is.
fn webp(head: &[u8]) -> Option<MediaSize> {
    let data = head.get(20..)?;
    match head.get(12..16)? {
        // Lossy: a key frame's start code, then 14-bit sizes (the top two bits are scaling).
        b"VP8 " => {
            if data.get(3..6)? != [0x9D, 0x01, 0x2A] {
                return None;
            }
            image(le(data, 6, 2)? & 0x3FFF, le(data, 8, 2)? & 0x3FFF)
        }
        // Lossless: a signature byte, then width-1 and height-1 in 14 bits each.
        b"VP8L" => {
            if *data.first()? != 0x2F {
                return None;
            }
            let bits = le(data, 1, 4)?;
            image((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
        }
        // Extended (alpha, animation, metadata): the canvas, width-1 and height-1 in 24 bits.
        b"VP8X" => image(le(data, 4, 3)? + 1, le(data, 7, 3)? + 1),
        _ => None,
    }
}

/// BMP: neither provider takes it, but it is cheap to size and an honest size beats a guess.
fn bmp(head: &[u8]) -> Option<MediaSize> {
    match le(head, 14, 4)? {
        12 => image(le(head, 18, 2)?, le(head, 20, 2)?),
        40.. => {
            let width = le(head, 18, 4)? as i32;
            // A negative height is a top-down bitmap, not a damaged one.
            let height = le(head, 22, 4)? as i32;
            if width <= 0 {
                return None;
            }
            image(width.unsigned_abs(), height.unsigned_abs())
        }
        _ => None,
    }
}

/// JPEG: the size is in the first start-of-frame segment, which may follow tens of
/// kilobytes of EXIF and other application segments, so the walk hops from segment to
/// segment by their lengths, decoding the bytes it skips through a small buffer.
fn jpeg(mut r: Decoder<'_>) -> Option<MediaSize> {
    fn array<const N: usize>(r: &mut impl Read) -> Option<[u8; N]> {
        let mut bytes = [0; N];
        r.read_exact(&mut bytes).ok()?;
        Some(bytes)
    }
    let [0xFF, 0xD8] = array(&mut r)? else {
        return None;
    };
    loop {
        let [0xFF, mut code] = array(&mut r)? else {
            return None;
        };
        // Any number of 0xFF fill bytes may come before the marker code.
        while code == 0xFF {
            [code] = array(&mut r)?;
        }
        match code {
            // TEM and the restart markers stand alone: no length follows.
            0x01 | 0xD0..=0xD7 => continue,
            // A second SOI, the end of the image, or the scan before any frame: not a
            // file we can size.
            0x00 | 0xD8 | 0xD9 | 0xDA => return None,
            _ => {}
        }
        let length = u64::from(u16::from_be_bytes(array(&mut r)?));
        // SOF0..SOF15 share a layout; C4 (DHT), C8 (JPG) and CC (DAC) sit in that range
        // but are not frames.
        if (0xC0..=0xCF).contains(&code) && !matches!(code, 0xC4 | 0xC8 | 0xCC) {
            if length < 7 {
                return None;
            }
            // Precision, then height before width.
            let frame: [u8; 5] = array(&mut r)?;
            return image(be(&frame, 3, 2)?, be(&frame, 1, 2)?);
        }
        let rest = length.checked_sub(2)?;
        if io::copy(&mut r.by_ref().take(rest), &mut io::sink()).ok()? != rest {
            return None;
        }
    }
}

// ---------------------------------------------------------------------------------------
// PDF page count
// ---------------------------------------------------------------------------------------

/// Where a PDF header may start: readers accept it anywhere in the first kilobyte.
const PDF_HEADER_WINDOW: u64 = 1024;

/// Dictionaries deeper than this are not followed: page trees are shallow, and a bound
/// keeps hostile nesting from costing anything.
const PDF_MAX_DEPTH: usize = 32;

/// Bytes inflated from a PDF's object streams, per file. Since PDF 1.5 a writer may put the
/// page tree in compressed object streams (pdfTeX and many others do by default), where no
/// plain-text scan can see it; this is far more than any page tree needs and bounds what a
/// deflate bomb can cost.
const PDF_INFLATE_BUDGET: u64 = 8 * 1024 * 1024;

fn pdf(payload: &str, mut budget: u64) -> Option<MediaSize> {
    let mut head = Vec::new();
    let _ = decode(payload)
        .take(PDF_HEADER_WINDOW)
        .read_to_end(&mut head);
    if !head.windows(5).any(|w| w == b"%PDF-") {
        return None;
    }
    let mut found = Found::default();
    scan(
        &mut BufReader::new(decode(payload)),
        &mut found,
        Some(&mut budget),
    );
    // The root `/Pages` node counts every page, and an incrementally updated file keeps
    // its older roots too, so the largest count wins. Without one (the page tree is in a
    // stream we could not read), the linearization hint or the page objects stand in.
    let pages = match found.count {
        0 => max(found.linearized, found.page_objects),
        count => count,
    };
    (pages > 0).then(|| MediaSize::Pdf {
        pages: u32::try_from(pages).unwrap_or(u32::MAX),
    })
}

/// The largest `/Count` of a `/Pages` node, the `/Page` objects, and the largest `/N` of a
/// linearization dictionary.
#[derive(Debug, Default)]
struct Found {
    count: u64,
    page_objects: u64,
    linearized: u64,
}

/// What a dictionary said, as far as counting pages goes.
#[derive(Debug, Clone, Copy, Default)]
struct Dict {
    pages: bool,
    page: bool,
    count: Option<u64>,
    linearized: bool,
    n: Option<u64>,
    object_stream: bool,
    filters: u8,
    /// The last filter named was Flate.
    flate: bool,
}

/// The dictionary key whose value the scanner is waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    None,
    Type,
    Count,
    /// `/Count n` was read, then `n g`: an `R` next makes it a reference, not a count.
    CountRef1,
    CountRef2,
    N,
    Linearized,
    Filter,
    FilterArray,
}

impl Dict {
    /// Takes a token inside this dictionary, the value of `key` if it is one, and returns
    /// the key the next token is the value of.
    fn take(&mut self, key: Key, token: Token) -> Key {
        match (key, token) {
            (Key::Type, Token::Name(name)) => {
                // `/Pages` is a tree node, `/Page` a leaf; a name is whole, so one never
                // matches the other.
                self.pages |= name.get() == b"Pages";
                self.page |= name.get() == b"Page";
                self.object_stream |= name.get() == b"ObjStm";
            }
            (Key::Filter, Token::ArrayOpen) => return Key::FilterArray,
            (Key::Filter | Key::FilterArray, Token::Name(name)) => {
                self.filters = self.filters.saturating_add(1);
                self.flate = name.get() == b"FlateDecode";
                if key == Key::FilterArray {
                    return key;
                }
            }
            (Key::Count, Token::Number(count)) => {
                self.count = count;
                if count.is_some() {
                    return Key::CountRef1;
                }
            }
            (Key::CountRef1, Token::Number(_)) => return Key::CountRef2,
            (Key::CountRef2, Token::Keyword(word)) if word.get() == b"R" => self.count = None,
            (Key::N, Token::Number(n)) => self.n = n,
            (Key::Linearized, Token::Number(_)) => self.linearized = true,
            (_, Token::Name(name)) => {
                return match name.get() {
                    b"Type" => Key::Type,
                    b"Count" => Key::Count,
                    b"N" => Key::N,
                    b"Linearized" => Key::Linearized,
                    b"Filter" => Key::Filter,
                    _ => Key::None,
                }
            }
            _ => {}
        }
        Key::None
    }
}

/// Reads PDF syntax from `src` for what counts pages: dictionary nesting, `/Type`, `/Count`
/// and the linearization dictionary's `/N`. Strings, comments and stream bodies are
/// stepped over, since look-alike bytes in them mean nothing; an object stream compressed
/// by Flate alone is inflated and read the same way while `budget` lasts (`None` inside
/// one). Other streams are images, fonts and page contents, which hold no page tree.
fn scan(src: &mut dyn BufRead, found: &mut Found, mut budget: Option<&mut u64>) {
    let mut lex = Lexer(src);
    let mut dicts = [Dict::default(); PDF_MAX_DEPTH];
    let mut depth = 0usize;
    let mut key = Key::None;
    // The last top-level dictionary closed, which a `stream` keyword belongs to.
    let mut last_top = None;
    while let Some(token) = lex.next() {
        let key_was = std::mem::replace(&mut key, Key::None);
        match token {
            Token::DictOpen => {
                if let Some(dict) = dicts.get_mut(depth) {
                    *dict = Dict::default();
                }
                depth = depth.saturating_add(1);
            }
            Token::DictClose => {
                let Some(top) = depth.checked_sub(1) else {
                    continue;
                };
                depth = top;
                let Some(&dict) = dicts.get(top) else {
                    continue;
                };
                if dict.pages {
                    found.count = max(found.count, dict.count.unwrap_or(0));
                } else if dict.page {
                    found.page_objects += 1;
                }
                if dict.linearized {
                    found.linearized = max(found.linearized, dict.n.unwrap_or(0));
                }
                if top == 0 {
                    last_top = Some(dict);
                }
            }
            Token::Keyword(word) if word.get() == b"stream" => {
                let inflate = depth == 0
                    && last_top.take().is_some_and(|dict: Dict| {
                        dict.object_stream && dict.filters == 1 && dict.flate
                    });
                match budget.as_deref_mut().filter(|left| inflate && **left > 0) {
                    Some(budget) => inflate_object_stream(&mut lex, budget, found),
                    None => lex.skip_stream(0),
                }
            }
            // Objects sit at the top level, so a dictionary a damaged object left open
            // must not shift every later one deeper.
            Token::Keyword(word) if matches!(word.get(), b"obj" | b"endobj") => {
                depth = 0;
                last_top = None;
            }
            token => {
                if let Some(dict) = depth.checked_sub(1).and_then(|top| dicts.get_mut(top)) {
                    key = dict.take(key_was, token);
                }
            }
        }
    }
}

/// Reads the zlib data at the start of a stream body as more PDF syntax, then skips the
/// rest of the body.
fn inflate_object_stream(lex: &mut Lexer<'_>, budget: &mut u64, found: &mut Found) {
    // The data starts after the end of line that follows `stream`.
    while lex.eat(is_white) {}
    let zlib = Inflate {
        src: &mut *lex.0,
        zlib: Decompress::new(true),
        last: 0,
        done: false,
    };
    let mut inflated = BufReader::new(zlib.take(*budget));
    scan(&mut inflated, found, None);
    let zlib = inflated.into_inner();
    *budget = zlib.limit();
    let last = zlib.into_inner().last;
    lex.skip_stream(last);
}

/// Inflates a zlib stream with `flate2`'s [`Decompress`], reading only as much of `src` as
/// the stream takes, and never past `endstream`: an inflater that ran on through damaged
/// data would swallow the objects after it.
///
/// `flate2`'s own readers drop a read's whole output when it meets damage, which in a
/// small object stream is all of it; this one hands out what came before the damage and
/// then ends, as a truncated file does.
struct Inflate<'a> {
    src: &'a mut dyn BufRead,
    zlib: Decompress,
    /// The last bytes of the stream body consumed, for [`Lexer::skip_stream`].
    last: u128,
    done: bool,
}

impl Read for Inflate<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while !self.done && !out.is_empty() {
            let input = self.src.fill_buf()?;
            let mut last = self.last;
            let end = input.iter().position(|&b| {
                last = shift_in(last, b);
                last == ENDSTREAM
            });
            let input = &input[..end.map_or(input.len(), |end| end + 1)];
            let (before_in, before_out) = (self.zlib.total_in(), self.zlib.total_out());
            let status = self.zlib.decompress(input, out, FlushDecompress::None);
            let used = (self.zlib.total_in() - before_in) as usize;
            let made = (self.zlib.total_out() - before_out) as usize;
            self.last = input[..used]
                .iter()
                .fold(self.last, |last, &b| shift_in(last, b));
            self.done = input.is_empty()
                || self.last == ENDSTREAM
                || (used == 0 && made == 0)
                || !matches!(status, Ok(Status::Ok | Status::BufError));
            self.src.consume(used);
            if made > 0 {
                return Ok(made);
            }
        }
        Ok(0)
    }
}

/// `endstream` as the last nine bytes read, kept as a number so the match carries across
/// buffers.
const ENDSTREAM: u128 = u128::from_be_bytes(*b"\0\0\0\0\0\0\0endstream");

fn shift_in(last: u128, b: u8) -> u128 {
    (last << 8 | u128::from(b)) & ((1 << 72) - 1)
}

/// A PDF token, as far as counting pages needs one.
#[derive(Debug, Clone, Copy)]
enum Token {
    Name(Word),
    /// A page count if it is one: a non-negative integer, not a real, a sign or overflow.
    Number(Option<u64>),
    Keyword(Word),
    DictOpen,
    DictClose,
    ArrayOpen,
    /// A string or another delimiter: not a value anything here waits for.
    Other,
}

/// A name or keyword; one longer than the buffer matches nothing we look for.
#[derive(Debug, Clone, Copy, Default)]
struct Word {
    bytes: [u8; 16],
    len: usize,
}

impl Word {
    fn get(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or(&[])
    }
}

struct Lexer<'a>(&'a mut dyn BufRead);

impl Lexer<'_> {
    fn next(&mut self) -> Option<Token> {
        loop {
            let b = self.skip_to(|b| !is_white(b))?;
            return Some(match b {
                b'%' => {
                    self.skip_to(|b| b == b'\r' || b == b'\n');
                    continue;
                }
                b'(' => {
                    self.skip_string();
                    Token::Other
                }
                b'<' if self.eat(|b| b == b'<') => Token::DictOpen,
                b'<' => {
                    self.skip_to(|b| b == b'>');
                    Token::Other
                }
                b'>' if self.eat(|b| b == b'>') => Token::DictClose,
                b'>' => continue,
                b'[' => Token::ArrayOpen,
                b')' | b']' | b'{' | b'}' => Token::Other,
                b'/' => Token::Name(self.word(&[])),
                b'0'..=b'9' | b'+' | b'-' | b'.' => {
                    Token::Number(parse_count(self.word(&[b]).get()))
                }
                _ => Token::Keyword(self.word(&[b])),
            });
        }
    }

    /// Consumes bytes up to and including the first `stop` accepts, which it returns, or
    /// to the end. It goes a buffer at a time: stream bodies are most of a PDF's bytes.
    fn skip_to(&mut self, mut stop: impl FnMut(u8) -> bool) -> Option<u8> {
        loop {
            let buf = self.0.fill_buf().ok().filter(|buf| !buf.is_empty())?;
            let (n, hit) = match buf.iter().position(|&b| stop(b)) {
                Some(at) => (at + 1, Some(buf[at])),
                None => (buf.len(), None),
            };
            self.0.consume(n);
            if hit.is_some() {
                return hit;
            }
        }
    }

    /// Consumes the next byte if `want` accepts it.
    fn eat(&mut self, want: impl Fn(u8) -> bool) -> bool {
        let next = self.0.fill_buf().ok().and_then(|buf| buf.first().copied());
        let hit = next.is_some_and(want);
        if hit {
            self.0.consume(1);
        }
        hit
    }

    /// Reads the rest of a name, number or keyword that starts with `first`.
    fn word(&mut self, first: &[u8]) -> Word {
        let mut word = Word::default();
        let mut push = |bytes: &[u8]| {
            for &b in bytes {
                if let Some(slot) = word.bytes.get_mut(word.len) {
                    *slot = b;
                }
                word.len = word.len.saturating_add(1);
            }
        };
        push(first);
        while let Ok(buf) = self.0.fill_buf() {
            let n = buf.iter().position(|&b| !is_regular(b));
            let used = n.unwrap_or(buf.len());
            let ended = n.is_some() || buf.is_empty();
            push(&buf[..used]);
            self.0.consume(used);
            if ended {
                break;
            }
        }
        word
    }

    /// Skips a stream body to its `endstream`, given the body's last bytes read so far.
    fn skip_stream(&mut self, mut last: u128) {
        if last != ENDSTREAM {
            self.skip_to(|b| {
                last = shift_in(last, b);
                last == ENDSTREAM
            });
        }
    }

    /// Skips a literal string: parentheses nest, and a backslash escapes the byte after it.
    fn skip_string(&mut self) {
        let (mut depth, mut escaped) = (1u32, false);
        self.skip_to(|b| {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'(' => depth = depth.saturating_add(1),
                b')' => depth -= 1,
                _ => {}
            }
            depth == 0
        });
    }
}

fn is_white(b: u8) -> bool {
    matches!(b, 0 | b'\t' | b'\n' | 0x0C | b'\r' | b' ')
}

/// PDF whitespace and delimiters end a token; everything else continues it.
fn is_regular(b: u8) -> bool {
    !is_white(b) && !b"()<>[]{}/%".contains(&b)
}

fn parse_count(word: &[u8]) -> Option<u64> {
    let digits = word.strip_prefix(b"+").unwrap_or(word);
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
}

// ---------------------------------------------------------------------------------------
// Anthropic
// ---------------------------------------------------------------------------------------

/// The most one image costs on Claude models before 4.7, and so the cost of one that
/// cannot be sized.
pub const ANTHROPIC_MAX_IMAGE_TOKENS: u64 = 1_600;

/// The most one image costs on Claude 4.7 and later (the high-resolution tier).
pub const ANTHROPIC_HIGH_RES_MAX_IMAGE_TOKENS: u64 = 5_000;

/// One of Claude's image tiers. `max_tokens` is the old page's "about 1,600 tokens" bound
/// on `w * h / 750`, scaled to the tier (3.75 MP / 750 = 5,000 for the high one), and
/// `max_patches` the current page's cap on 28 px patches.
struct ClaudeTier {
    long_edge: f64,
    max_tokens: u64,
    max_patches: u64,
}

const CLAUDE_STANDARD: ClaudeTier = ClaudeTier {
    long_edge: 1568.0,
    max_tokens: ANTHROPIC_MAX_IMAGE_TOKENS,
    max_patches: 1_568,
};

const CLAUDE_HIGH_RES: ClaudeTier = ClaudeTier {
    long_edge: 2576.0,
    max_tokens: ANTHROPIC_HIGH_RES_MAX_IMAGE_TOKENS,
    max_patches: 4_784,
};

/// Tokens Claude (before 4.7) bills for an image of this size, after its own downscaling.
///
/// A zero side cannot be sized and costs [`ANTHROPIC_MAX_IMAGE_TOKENS`].
pub fn anthropic_image_tokens(width: u32, height: u32) -> u64 {
    claude_tokens(width, height, &CLAUDE_STANDARD)
}

/// Tokens `model` bills for an image of this size: the high-resolution tier for Claude 4.7
/// and later, and for any model whose version cannot be read (the worst case).
pub fn anthropic_image_tokens_for(model: &str, width: u32, height: u32) -> u64 {
    claude_tokens(width, height, claude_tier(model))
}

/// The most one image costs on `model`, for an image that cannot be sized.
pub fn anthropic_max_image_tokens_for(model: &str) -> u64 {
    claude_tier(model).max_tokens
}

fn claude_tokens(width: u32, height: u32, tier: &ClaudeTier) -> u64 {
    if width == 0 || height == 0 {
        return tier.max_tokens;
    }
    let (w, h) = (f64::from(width), f64::from(height));
    let pixel_budget = (tier.max_tokens * 750) as f64;
    let scale = (tier.long_edge / w.max(h))
        .min((pixel_budget / (w * h)).sqrt())
        .min(1.0);
    let (w, h) = (
        max(1, (w * scale).floor() as u64),
        max(1, (h * scale).floor() as u64),
    );
    // The old page's area rule and the current page's patch count disagree by a few
    // percent either way (small images cost more as patches); a reservation takes the larger.
    let by_area = (w * h).div_ceil(750);
    let by_patches = min(w.div_ceil(28) * h.div_ceil(28), tier.max_patches);
    min(max(by_area, by_patches), tier.max_tokens)
}

fn claude_tier(model: &str) -> &'static ClaudeTier {
    match claude_version(model) {
        Some((major, minor)) if major < 4 || (major == 4 && minor < 7) => &CLAUDE_STANDARD,
        _ => &CLAUDE_HIGH_RES,
    }
}

/// The model generation in a Claude id, whatever wraps it: `claude-3-5-sonnet-20241022`,
/// `claude-opus-4-7`, `anthropic.claude-sonnet-4-20250514-v1:0`, `claude-opus-4-1@20250805`.
fn claude_version(model: &str) -> Option<(u32, u32)> {
    let lower = model.to_ascii_lowercase();
    let rest = &lower[lower.find("claude")? + "claude".len()..];
    let mut parts = rest
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|p| !p.is_empty())
        .skip_while(|p| !is_short_number(p));
    let major: u32 = parts.next()?.parse().ok()?;
    let minor = match parts.next() {
        Some(p) if is_short_number(p) => p.parse().ok()?,
        // A snapshot date, a family name or nothing: the first release of that generation.
        Some(p) if major != 4 || p.bytes().all(|b| b.is_ascii_digit()) => 0,
        None => 0,
        // `claude-opus-4-latest` and the like: which 4.x is not said, so no tier is assumed.
        Some(_) => return None,
    };
    Some((major, minor))
}

fn is_short_number(p: &str) -> bool {
    !p.is_empty() && p.len() <= 2 && p.bytes().all(|b| b.is_ascii_digit())
}

// ---------------------------------------------------------------------------------------
// Documents
// ---------------------------------------------------------------------------------------

/// The top of Anthropic's "1,500-3,000 tokens" of text a PDF page typically uses.
const PDF_PAGE_TEXT_TOKENS: u64 = 3_000;

/// The most one PDF page costs on Claude before 4.7: its text at the top of the documented
/// range plus the page as an image at the most an image costs.
pub const PDF_PAGE_TOKENS: u64 = PDF_PAGE_TEXT_TOKENS + ANTHROPIC_MAX_IMAGE_TOKENS;

/// Pages a document is reserved as when it cannot be sized (a URL, a file id, unreadable
/// data): Backstop's own floor, not a provider figure, chosen so that an unsized document
/// still reserves what a short report costs.
pub const UNSIZED_DOCUMENT_PAGES: u32 = 10;

/// The most a PDF of `pages` pages costs on Claude before 4.7.
pub fn pdf_tokens(pages: u32) -> u64 {
    u64::from(pages) * PDF_PAGE_TOKENS
}

/// The most a PDF of `pages` pages costs on `model`, whose page images follow its image tier.
pub fn pdf_tokens_for(model: &str, pages: u32) -> u64 {
    u64::from(pages) * (PDF_PAGE_TEXT_TOKENS + anthropic_max_image_tokens_for(model))
}

// ---------------------------------------------------------------------------------------
// OpenAI
// ---------------------------------------------------------------------------------------

/// The `detail` an OpenAI image input asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Detail {
    Low,
    High,
    /// The model's default: `high` sizing, or `original` on the models that say so.
    Auto,
    /// Full resolution, where the model has it (gpt-5.4 and later); `high` elsewhere.
    Original,
}

impl Detail {
    /// Reads a request's `detail` field: absent is `Auto`, unknown is `Original` (the costliest).
    pub fn from_param(value: Option<&str>) -> Detail {
        let Some(value) = value.map(str::trim) else {
            return Detail::Auto;
        };
        if value.eq_ignore_ascii_case("low") {
            Detail::Low
        } else if value.eq_ignore_ascii_case("high") {
            Detail::High
        } else if value.eq_ignore_ascii_case("auto") {
            Detail::Auto
        } else {
            Detail::Original
        }
    }
}

/// A patch-rule pixel limit (the image is fitted inside `max_side` squared) and budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limit {
    max_side: u32,
    budget: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Tile { base: u64, per_tile: u64 },
    Patch(Patch),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Patch {
    /// Tokens per patch, in hundredths, so 1.62 rounds up exactly.
    multiplier: u64,
    low: Limit,
    high: Limit,
    original: Limit,
    auto_is_original: bool,
}

impl Patch {
    fn limit(&self, detail: Detail) -> Limit {
        match detail {
            Detail::Low => self.low,
            Detail::High => self.high,
            Detail::Original => self.original,
            Detail::Auto if self.auto_is_original => self.original,
            Detail::Auto => self.high,
        }
    }

    fn tokens(&self, patches: u64) -> u64 {
        (patches * self.multiplier).div_ceil(100)
    }
}

const fn limit(max_side: u32, budget: u64) -> Limit {
    Limit {
        max_side,
        budget: Some(budget),
    }
}

const fn unbudgeted(max_side: u32) -> Limit {
    Limit {
        max_side,
        budget: None,
    }
}

const fn tile(base: u64, per_tile: u64) -> Rule {
    Rule::Tile { base, per_tile }
}

/// A patch model whose docs give one set of limits for every detail level, or none for
/// `low`: then `low` is reserved as `high`, since `low` is documented as not always cheaper.
const fn uniform(multiplier: u64, all: Limit) -> Rule {
    Rule::Patch(Patch {
        multiplier,
        low: all,
        high: all,
        original: all,
        auto_is_original: false,
    })
}

/// gpt-5.4, -mini, -nano: `low` is 2048 px / 6,144 patches (so it can cost more than `high`),
/// `high` 2048 px / 2,500, `original` 6000 px / 10,000, and `auto` sizes as `high`.
const fn gpt_5_4(multiplier: u64) -> Rule {
    Rule::Patch(Patch {
        multiplier,
        low: limit(2048, 6_144),
        high: limit(2048, 2_500),
        original: limit(6000, 10_000),
        auto_is_original: false,
    })
}

/// Model families by id prefix, most specific first: `gpt-4o-mini` must be tried before
/// `gpt-4o`, and a family matches only at a separator, so `gpt-5` is not `gpt-5.4`.
///
/// Figures are OpenAI's "Calculating costs" tables. Where two versions of the page differ,
/// the costlier is kept: gpt-5-mini and gpt-5-nano are 1.62 and 2.46 on one and 1.2 and 1.5
/// on the next; gpt-4.1-mini and gpt-5.2 moved from a 1,536 to a 6,144 budget; gpt-5.4-mini
/// and -nano from 1,536 patches at 1.62 and 2.46 to 2,500 at 1.2. The codex variants in the
/// 1,536-patch group have no published multiplier, so they take their family's.
const OPENAI_RULES: &[(&str, Rule)] = &[
    (
        "gpt-5.6",
        Rule::Patch(Patch {
            multiplier: 120,
            low: limit(512, 256),
            high: limit(2048, 2_500),
            original: unbudgeted(65_535),
            auto_is_original: true,
        }),
    ),
    (
        "gpt-5.5",
        Rule::Patch(Patch {
            multiplier: 120,
            low: limit(512, 256),
            high: limit(2048, 2_500),
            original: limit(6000, 10_000),
            auto_is_original: true,
        }),
    ),
    ("gpt-5.4-mini", gpt_5_4(162)),
    ("gpt-5.4-nano", gpt_5_4(246)),
    ("gpt-5.4", gpt_5_4(120)),
    ("gpt-5.3", uniform(120, limit(2048, 6_144))),
    ("gpt-5.2", uniform(120, limit(2048, 6_144))),
    ("gpt-5.1-codex-mini", uniform(162, limit(2048, 1_536))),
    ("gpt-5.1", tile(70, 140)),
    ("gpt-5-codex-mini", uniform(162, limit(2048, 1_536))),
    ("gpt-5-mini", uniform(162, limit(2048, 1_536))),
    ("gpt-5-nano", uniform(246, limit(2048, 1_536))),
    ("gpt-5", tile(70, 140)),
    ("gpt-4.1-mini", uniform(162, limit(2048, 6_144))),
    ("gpt-4.1-nano", uniform(246, limit(2048, 1_536))),
    ("gpt-4.1", tile(85, 170)),
    ("gpt-4.5", tile(85, 170)),
    ("gpt-4o-mini", tile(2833, 5667)),
    ("gpt-4o", tile(85, 170)),
    ("chatgpt-4o", tile(85, 170)),
    ("gpt-4-turbo", tile(85, 170)),
    ("o4-mini", uniform(172, limit(2048, 1_536))),
    ("o1-pro", tile(75, 150)),
    ("o1", tile(75, 150)),
    ("o3", tile(75, 150)),
    ("computer-use-preview", tile(65, 129)),
];

/// What a model we do not know is charged: the tile rule at GPT-4o's figures, the rule
/// most vision models have used.
const OPENAI_DEFAULT_RULE: Rule = tile(85, 170);

/// The rule for `model`, after dropping a provider prefix (`azure/`, `openai/`), a
/// fine-tune's `ft:` and case.
fn openai_rule(model: &str) -> Rule {
    let lower = model.trim().to_ascii_lowercase();
    let name = lower.rsplit('/').next().unwrap_or("");
    let name = name.strip_prefix("ft:").unwrap_or(name);
    OPENAI_RULES
        .iter()
        .find(|(family, _)| {
            name.strip_prefix(*family)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['-', ':', '@', '_']))
        })
        .map_or(OPENAI_DEFAULT_RULE, |&(_, rule)| rule)
}

/// Tokens OpenAI bills `model` for an image of this size at this detail.
///
/// A zero side cannot be sized and costs [`openai_max_image_tokens`].
pub fn openai_image_tokens(model: &str, width: u32, height: u32, detail: Detail) -> u64 {
    if width == 0 || height == 0 {
        return openai_max_image_tokens(model, detail);
    }
    let (w, h) = (u64::from(width), u64::from(height));
    match openai_rule(model) {
        Rule::Tile { base, .. } if detail == Detail::Low => base,
        Rule::Tile { base, per_tile } => {
            let (w, h) = scale_down(w, h, max(w, h), 2048);
            let (w, h) = scale_down(w, h, min(w, h), 768);
            base + per_tile * (w.div_ceil(512) * h.div_ceil(512))
        }
        Rule::Patch(patch) => patch.tokens(patches(w, h, patch.limit(detail))),
    }
}

/// The most one image costs `model` at this detail, for an image that cannot be sized.
pub fn openai_max_image_tokens(model: &str, detail: Detail) -> u64 {
    match openai_rule(model) {
        Rule::Tile { base, .. } if detail == Detail::Low => base,
        // Inside 2048 px with the shortest side at most 768: 2 x 4 tiles at most.
        Rule::Tile { base, per_tile } => base + per_tile * 8,
        Rule::Patch(patch) => {
            let limit = patch.limit(detail);
            let side = u64::from(limit.max_side).div_ceil(32);
            patch.tokens(limit.budget.map_or(side * side, |b| min(b, side * side)))
        }
    }
}

/// Scales down (never up) so that `edge`, the longer or the shorter side, is `side`,
/// rounding both sides down.
fn scale_down(w: u64, h: u64, edge: u64, side: u64) -> (u64, u64) {
    if edge <= side {
        return (w, h);
    }
    (max(1, w * side / edge), max(1, h * side / edge))
}

/// 32 px patches covering the image once fitted in the limit's square and, over budget,
/// shrunk the way the docs give it: by `sqrt(32^2 * budget / (w * h))`, adjusted so whole
/// patches fit, with the final pixel sizes rounded down.
fn patches(w: u64, h: u64, limit: Limit) -> u64 {
    let (w, h) = scale_down(w, h, max(w, h), u64::from(limit.max_side));
    let count = w.div_ceil(32) * h.div_ceil(32);
    let Some(budget) = limit.budget.filter(|&b| count > b) else {
        return count;
    };
    // The docs' arithmetic is in floating point; the epsilon keeps an exact 50.0 that
    // comes out as 49.999... from losing a whole row of patches.
    let floor = |x: f64| (x + 1e-9).floor();
    let (wf, hf) = (w as f64, h as f64);
    let shrink = (1024.0 * budget as f64 / (wf * hf)).sqrt();
    let (across, down) = (wf * shrink / 32.0, hf * shrink / 32.0);
    let adjusted = shrink * (floor(across) / across).min(floor(down) / down);
    let (rw, rh) = (floor(wf * adjusted), floor(hf * adjusted));
    // Also catches NaN: a degenerate shrink is charged the whole budget.
    if !(rw >= 1.0 && rh >= 1.0) {
        return budget;
    }
    min((rw as u64).div_ceil(32) * (rh as u64).div_ceil(32), budget)
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
    use base64::Engine;
    use flate2::{write::ZlibEncoder, Compression};
    use std::io::Write;
    use Detail::{Auto, High, Low, Original};

    fn b64(bytes: &[u8]) -> String {
        STANDARD.encode(bytes)
    }

    fn img(width: u32, height: u32) -> MediaSize {
        MediaSize::Image { width, height }
    }

    fn pages(pages: u32) -> MediaSize {
        MediaSize::Pdf { pages }
    }

    /// A tiny xorshift: the property tests need noise, not a dependency.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        fn bytes(&mut self, len: usize) -> Vec<u8> {
            (0..len).map(|_| self.next() as u8).collect()
        }
    }

    fn png_header(width: u32, height: u32) -> Vec<u8> {
        let mut png = PNG_SIGNATURE.to_vec();
        png.extend_from_slice(&13u32.to_be_bytes());
        png.extend_from_slice(b"IHDR");
        png.extend_from_slice(&width.to_be_bytes());
        png.extend_from_slice(&height.to_be_bytes());
        png.extend_from_slice(&[8, 6, 0, 0, 0]);
        png.extend_from_slice(&[0xDE, 0xAD, 0xBE, 0xEF]); // CRC: nothing here checks it
        png
    }

    fn segment(marker: u8, payload: &[u8]) -> Vec<u8> {
        let length = (payload.len() as u16 + 2).to_be_bytes();
        [&[0xFF, marker], &length, payload].concat()
    }

    fn sof(marker: u8, width: u16, height: u16) -> Vec<u8> {
        let components = [3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1];
        let frame = [
            &[8],
            &height.to_be_bytes()[..],
            &width.to_be_bytes(),
            &components,
        ]
        .concat();
        segment(marker, &frame)
    }

    /// SOI, JFIF, a 40 KB EXIF block, a DQT and a DHT, then the frame, a scan and EOI.
    fn jpeg_640x480() -> Vec<u8> {
        let mut jpeg = vec![0xFF, 0xD8];
        jpeg.extend(segment(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"));
        jpeg.extend(segment(
            0xE1,
            &[b"Exif\0\0".to_vec(), XorShift(11).bytes(40 * 1024)].concat(),
        ));
        jpeg.extend(segment(0xDB, &[0; 65]));
        // A DHT holding bytes that look like a frame must be skipped, not read.
        jpeg.extend(segment(0xC4, &[0xFF, 0xC0, 0, 17, 8, 0, 1, 0, 1]));
        jpeg.extend_from_slice(&[0xFF, 0xFF]); // fill bytes before the next marker
        jpeg.extend(sof(0xC0, 640, 480));
        jpeg.extend(segment(0xDA, &[1, 1, 0, 0, 63, 0]));
        jpeg.extend(XorShift(3).bytes(1000));
        jpeg.extend_from_slice(&[0xFF, 0xD9]);
        jpeg
    }

    fn gif(width: u16, height: u16) -> Vec<u8> {
        let mut gif = [b"GIF89a", &width.to_le_bytes()[..], &height.to_le_bytes()].concat();
        gif.extend_from_slice(&[0xF7, 0, 0]);
        gif.extend(XorShift(5).bytes(100));
        gif.push(0x3B);
        gif
    }

    fn riff(chunk: &[u8; 4], data: &[u8]) -> Vec<u8> {
        let (size, riff_size) = (data.len() as u32, data.len() as u32 + 12);
        let head = [
            &b"RIFF"[..],
            &riff_size.to_le_bytes(),
            b"WEBP",
            chunk,
            &size.to_le_bytes(),
        ];
        [&head.concat(), data].concat()
    }

    fn webp_lossy(width: u16, height: u16) -> Vec<u8> {
        let mut data = vec![0x30, 0x01, 0x00, 0x9D, 0x01, 0x2A];
        // The top two bits are the upscaling hint and must not leak into the size.
        data.extend_from_slice(&(width | 0x4000).to_le_bytes());
        data.extend_from_slice(&(height | 0x8000).to_le_bytes());
        data.extend(XorShift(13).bytes(64));
        riff(b"VP8 ", &data)
    }

    fn webp_lossless(width: u32, height: u32) -> Vec<u8> {
        let bits = (width - 1) | (height - 1) << 14 | 1 << 28;
        let data = [&[0x2F], &bits.to_le_bytes()[..], &XorShift(17).bytes(64)].concat();
        riff(b"VP8L", &data)
    }

    fn webp_extended(width: u32, height: u32) -> Vec<u8> {
        let (w, h) = ((width - 1).to_le_bytes(), (height - 1).to_le_bytes());
        let data = [&[0x10, 0, 0, 0], &w[..3], &h[..3]].concat();
        [riff(b"VP8X", &data), b"ALPH\x04\0\0\0\0\0\0\0".to_vec()].concat()
    }

    fn bmp(width: i32, height: i32) -> Vec<u8> {
        let (w, h) = (width.to_le_bytes(), height.to_le_bytes());
        [
            &b"BM"[..],
            &[0; 12],
            &40u32.to_le_bytes(),
            &w,
            &h,
            &[1, 0, 24, 0],
            &[0; 24],
        ]
        .concat()
    }

    /// A small but real-shaped PDF: a catalog, a page tree, `n` pages with content streams
    /// holding syntax-like noise, an outline with its own `/Count`, and a trailer.
    fn sample_pdf(n: u32, count_in_tree: bool) -> Vec<u8> {
        let kids: Vec<String> = (0..n).map(|i| format!("{} 0 R", 10 + i)).collect();
        let count = if count_in_tree {
            format!("/Count {n}")
        } else {
            String::new()
        };
        let mut pdf = format!(
            "%PDF-1.7\n%\u{E2}\u{E3}\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R /Outlines 9 0 R >>\n\
             endobj\n2 0 obj\n<< /Type /Pages /Kids [{}] {count} >>\nendobj\n\
             9 0 obj\n<< /Type /Outlines /Count 99 >>\nendobj\n",
            kids.join(" ")
        )
        .into_bytes();
        for i in 0..n {
            let ty = if i % 2 == 0 {
                "/Type /Page"
            } else {
                "/Type/Page"
            };
            let body =
                "BT /F1 12 Tf (a << /Type /Page >> string) Tj ET\n<< /Type /Pages /Count 500 >>\n";
            let page = format!(
                "{} 0 obj\n<< {ty} /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font \
                 << /F1 5 0 R >> >> /Contents {} 0 R >>\nendobj\n{1} 0 obj\n<< /Length {} >>\n\
                 stream\n{body}",
                10 + i,
                100 + i,
                body.len()
            );
            pdf.extend_from_slice(page.as_bytes());
            pdf.extend(XorShift(u64::from(i) + 1).bytes(300));
            pdf.extend_from_slice(b"\nendstream\nendobj\n");
        }
        pdf.extend_from_slice(
            b"xref\n0 1\n0000000000 65535 f \ntrailer\n<< /Size 3 /Root 1 0 R >>\n",
        );
        pdf.extend_from_slice(b"startxref\n0\n%%EOF\n");
        pdf
    }

    fn zlib(data: &[u8], level: u32) -> Vec<u8> {
        let mut encoder = ZlibEncoder::new(Vec::new(), Compression::new(level));
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// An object stream's objects: the page tree's root (`/Count 36`; the rest of its
    /// pages are in other streams) and three pages.
    fn page_tree_objects() -> Vec<u8> {
        let root = "<< /Type /Pages /Kids [11 0 R 12 0 R 13 0 R] /Count 36 >>\n";
        let page = "<< /Type /Page /Parent 10 0 R /Resources << /Font << /F1 20 0 R >> >> >>\n";
        format!("10 0 11 58 12 97 13 136\n{root}{}", page.repeat(3)).into_bytes()
    }

    /// A PDF whose page tree is only inside a compressed object stream.
    fn pdf_with_object_stream(filter: &str, data: &[u8]) -> Vec<u8> {
        let mut pdf = format!(
            "%PDF-1.5\n%\u{E2}\u{E3}\n5 0 obj\n<< /Type /ObjStm /N 4 /First 24 {filter} \
             /Length {} >>\nstream\r\n",
            data.len()
        )
        .into_bytes();
        pdf.extend_from_slice(data);
        pdf.extend_from_slice(b"\nendstream\nendobj\n");
        pdf.extend_from_slice(b"6 0 obj\n<< /Type /XRef /Size 7 /Filter /FlateDecode >>\nstream\n");
        pdf.extend(XorShift(77).bytes(64));
        pdf.extend_from_slice(b"\nendstream\nendobj\nstartxref\n0\n%%EOF\n");
        pdf
    }

    #[test]
    fn pdf_pages_are_read_from_compressed_object_streams() {
        let objects = page_tree_objects();
        let root_end = objects.windows(2).position(|w| w == b">>").unwrap() + 2;
        // Stored blocks at level 0, dynamic-code ones at 1 and 9.
        for level in [0, 1, 9] {
            let data = zlib(&objects, level);
            for filter in ["/Filter /FlateDecode", "/Filter [/FlateDecode]"] {
                let doc = pdf_with_object_stream(filter, &data);
                assert_eq!(sniff(&b64(&doc)), pages(36), "{filter}, level {level}");
            }
            // Damage partway through keeps what came before it: a flush makes the root's
            // bytes whole, then the data is cut halfway through the rest.
            let mut encoder = ZlibEncoder::new(Vec::new(), Compression::new(level));
            encoder.write_all(&objects[..root_end]).unwrap();
            encoder.flush().unwrap();
            let flushed = encoder.get_ref().len();
            encoder.write_all(&objects[root_end..]).unwrap();
            let data = encoder.finish().unwrap();
            let doc =
                pdf_with_object_stream("/Filter /FlateDecode", &data[..(flushed + data.len()) / 2]);
            assert_eq!(sniff(&b64(&doc)), pages(36), "damaged, level {level}");
        }
        // Filters other than Flate alone are not decoded, so nothing is found.
        let data = zlib(&page_tree_objects(), 6);
        for filter in [
            "/Filter /LZWDecode",
            "/Filter [/ASCII85Decode /FlateDecode]",
            "",
        ] {
            let doc = pdf_with_object_stream(filter, &data);
            assert_eq!(sniff(&b64(&doc)), MediaSize::Unknown, "{filter}");
        }
    }

    #[test]
    fn inflating_is_bounded() {
        // The budget stops the inflater where it runs out: just after the root's `>>`,
        // or just before.
        let objects = page_tree_objects();
        let end = objects.windows(2).position(|w| w == b">>").unwrap() as u64 + 2;
        let doc = b64(&pdf_with_object_stream(
            "/Filter /FlateDecode",
            &zlib(&objects, 9),
        ));
        assert_eq!(pdf(&doc, end), Some(pages(36)));
        assert_eq!(pdf(&doc, end - 1), None);
        // A bomb, 12 MB of spaces from 12 KB, stops at the file's budget: the page tree at
        // its end is not read, but the one after the stream still is.
        let bomb = |tree_first: bool| {
            let mut encoder = ZlibEncoder::new(Vec::new(), Compression::best());
            let tree = b"<< /Type /Pages /Count 70 >>";
            encoder
                .write_all(if tree_first { tree } else { b"" })
                .unwrap();
            for _ in 0..12 * 16 {
                encoder.write_all(&[b' '; 64 * 1024]).unwrap();
            }
            encoder.write_all(tree).unwrap();
            let data = encoder.finish().unwrap();
            let mut doc = pdf_with_object_stream("/Filter /FlateDecode", &data);
            doc.extend_from_slice(b"7 0 obj << /Type /Pages /Count 9 >> endobj\n");
            doc
        };
        let doc = bomb(false);
        assert!(doc.len() < 200_000, "{}", doc.len());
        let started = std::time::Instant::now();
        assert_eq!(sniff(&b64(&doc)), pages(9));
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        // The bomb really does inflate: its first bytes are read.
        assert_eq!(sniff(&b64(&bomb(true))), pages(70));
    }

    #[test]
    fn a_megabyte_png_is_sized_from_its_header() {
        let idat = [
            &(3u32 << 20).to_be_bytes()[..],
            b"IDAT",
            &XorShift(7).bytes(3 << 20),
        ];
        let data = b64(&[png_header(1024, 1024), idat.concat()].concat());
        assert!(data.len() > 4_000_000);
        assert_eq!(sniff(&data), img(1024, 1024));
        assert_eq!(anthropic_image_tokens(1024, 1024), 1_399);
        assert_eq!(openai_image_tokens("gpt-4o", 1024, 1024, High), 765);
        assert_eq!(openai_image_tokens("gpt-4o", 1024, 1024, Low), 85);
        // The old estimate, bytes / 4, would have reserved a million tokens.
        assert!(data.len() as u64 / 4 > 700 * anthropic_image_tokens(1024, 1024));
    }

    #[test]
    fn only_the_header_is_decoded() {
        // Everything after the header is not base64 at all; reading it would fail.
        let mut data = b64(&png_header(800, 600));
        assert_eq!(data.len() % 4, 0);
        data.push_str("*** not base64, and never read ***");
        assert_eq!(sniff(&data), img(800, 600));
    }

    #[test]
    fn base64_layout_does_not_matter() {
        let png = png_header(31, 17);
        let padded = b64(&png);
        let lines = padded
            .as_bytes()
            .chunks(8)
            .map(|c| std::str::from_utf8(c).unwrap());
        let wrapped = lines.collect::<Vec<_>>().join("\r\n ");
        let url = format!("data:image/png;base64,{padded}");
        for data in [padded.clone(), STANDARD_NO_PAD.encode(&png), wrapped, url] {
            assert_eq!(sniff(&data), img(31, 17), "{data:?}");
        }
        // A stray byte ends the data, but what came before it still counts.
        let mut doc = b64(&sample_pdf(3, true));
        doc.insert(doc.len() - 40, '*');
        assert_eq!(sniff(&doc), pages(3));
    }

    #[test]
    fn the_decoder_round_trips() {
        let mut rng = XorShift(1234);
        for len in 0..200 {
            let bytes = rng.bytes(len);
            for data in [STANDARD.encode(&bytes), STANDARD_NO_PAD.encode(&bytes)] {
                let (mut decoder, mut out, mut n) = (decode(&data), vec![0u8; len + 8], 0);
                // Small reads, to cross every boundary.
                while let Ok(k @ 1..) = decoder.read(&mut out[n..min(n + 3, len + 8)]) {
                    n += k;
                }
                assert_eq!(&out[..n], &bytes[..], "{data}");
            }
        }
    }

    #[test]
    fn data_urls_split_into_media_type_and_payload() {
        let url = data_url_payload;
        assert_eq!(
            url("data:image/png;base64,iVBO"),
            Some(("image/png", "iVBO"))
        );
        let pdf = url("DATA:application/pdf;name=a.pdf;BASE64,JVBE");
        assert_eq!(pdf, Some(("application/pdf", "JVBE")));
        assert_eq!(url("data:;base64,QQ=="), Some(("text/plain", "QQ==")));
        for bad in [
            "data:text/plain,hello",
            "data:image/png;base64",
            "https://a.b/c.png",
            "dat",
        ] {
            assert_eq!(url(bad), None, "{bad}");
        }
        assert_eq!(url("dataé:x;base64,"), None);
    }

    #[test]
    fn images_are_sized_from_their_headers() {
        let jpeg = jpeg_640x480();
        assert!(jpeg.len() > 40 * 1024);
        assert_eq!(sniff(&b64(&jpeg)), img(640, 480));
        // Progressive and other frame types share the layout.
        for marker in [0xC1, 0xC2, 0xC3, 0xC5, 0xC7, 0xC9, 0xCB, 0xCD, 0xCF] {
            let jpeg = [
                vec![0xFF, 0xD8],
                segment(0xE0, b"JFIF\0"),
                sof(marker, 1920, 1080),
            ];
            assert_eq!(
                sniff(&b64(&jpeg.concat())),
                img(1920, 1080),
                "SOF {marker:#x}"
            );
        }
        assert_eq!(sniff(&b64(&gif(10, 20))), img(10, 20));
        assert_eq!(sniff(&b64(&webp_lossy(400, 300))), img(400, 300));
        assert_eq!(sniff(&b64(&webp_lossless(1000, 750))), img(1000, 750));
        assert_eq!(sniff(&b64(&webp_lossless(16384, 1))), img(16384, 1));
        assert_eq!(sniff(&b64(&webp_extended(20000, 10000))), img(20000, 10000));
        assert_eq!(sniff(&b64(&bmp(123, -456))), img(123, 456));
    }

    #[test]
    fn truncated_or_damaged_headers_are_unknown() {
        let cases: Vec<Vec<u8>> = vec![
            png_header(1024, 1024)[..20].to_vec(),
            png_header(0, 1024),
            png_header(1024, 0),
            png_header(u32::MAX, 5),
            gif(10, 20)[..8].to_vec(),
            gif(0, 20),
            webp_lossy(400, 300)[..24].to_vec(),
            riff(b"VP8 ", &[0; 10]),
            riff(b"VP8L", &[0x2E, 0, 0, 0, 0]),
            riff(b"ABCD", &[0; 10]),
            vec![0xFF, 0xD8],
            vec![0xFF, 0xD8, 0xFF],
            vec![0xFF, 0xD8, 0x00, 0x00],
            vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01],
            // A JPEG whose scan comes before any frame, one cut off inside its EXIF block,
            // and one with a zero height (defined later by DNL), which cannot be reserved from.
            [
                vec![0xFF, 0xD8],
                segment(0xE0, b"JFIF\0"),
                segment(0xDA, &[0; 6]),
            ]
            .concat(),
            jpeg_640x480()[..20_000].to_vec(),
            [vec![0xFF, 0xD8], sof(0xC0, 640, 0)].concat(),
            bmp(0, 10),
            bmp(-5, 10),
            b"BM".to_vec(),
            b"%PDF-".to_vec(),
            b"%PDF-1.7\n<< /Type /Pages /Count 0 >>".to_vec(),
        ];
        for bytes in cases {
            assert_eq!(sniff(&b64(&bytes)), MediaSize::Unknown, "{bytes:?}");
        }
        let garbage = [
            "",
            "   \n",
            "====",
            "A",
            "AA==",
            "!!!!",
            "hello world",
            "héllo wörld ☃",
        ];
        let more = [
            "data:image/png;base64,",
            "data:image/png,notbase64",
            "QUJDREVGR0g=",
            "\0\x01\x02",
        ];
        for data in garbage.into_iter().chain(more) {
            assert_eq!(sniff(data), MediaSize::Unknown, "{data:?}");
        }
    }

    #[test]
    fn pdf_pages_come_from_the_page_tree() {
        assert_eq!(sniff(&b64(&sample_pdf(3, true))), pages(3));
        // No /Count: the page objects are counted, with or without a space after /Type.
        assert_eq!(sniff(&b64(&sample_pdf(3, false))), pages(3));
        // The tree's count wins over the page objects actually present.
        let twelve = b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n\
            2 0 obj << /Kids [3 0 R 4 0 R] /Type /Pages /Count 12 >> endobj\n\
            3 0 obj << /Type /Pages /Parent 2 0 R /Count 10 >> endobj\n\
            4 0 obj << /Type /Page /Parent 2 0 R >> endobj\n%%EOF";
        assert_eq!(sniff(&b64(twelve)), pages(12));
        // A linearized file gives its page count up front.
        let linearized = b"%PDF-1.5\n1 0 obj << /Linearized 1 /L 90210 /N 42 /T 9000 >> endobj\n\
            2 0 obj << /Type /ObjStm /N 5 /Length 4 >> stream\n\x78\x9c\x01\x02\nendstream endobj\n";
        assert_eq!(sniff(&b64(linearized)), pages(42));
    }

    #[test]
    fn pdf_look_alikes_are_not_counted() {
        // A count given by reference is not a count; the page objects stand in.
        let by_ref = b"%PDF-1.4\n2 0 obj << /Type /Pages /Count 7 0 R >> endobj\n\
            3 0 obj << /Type /Page >> endobj\n4 0 obj << /Type /Page >> endobj\n";
        assert_eq!(sniff(&b64(by_ref)), pages(2));
        // Strings, comments and streams hold syntax-like bytes that mean nothing.
        let noise = b"%PDF-1.4\n% << /Type /Pages /Count 40 >>\n\
            1 0 obj << /Title (<< /Type /Pages /Count 41 >>) /Type /Page >> endobj\n\
            2 0 obj << /Length 9 >> stream\n<< /Type /Pages /Count 42 >>\nendstream endobj\n";
        assert_eq!(sniff(&b64(noise)), pages(1));
        // An object left unclosed by damage does not hide the ones after it.
        let damaged = b"%PDF-1.4\n1 0 obj << /Type /Catalog << << endobj\n\
            2 0 obj << /Type /Pages /Count 5 >> endobj\n";
        assert_eq!(sniff(&b64(damaged)), pages(5));
        // Only a page count: a PDF with none of these is unknown.
        let empty = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF";
        assert_eq!(sniff(&b64(empty)), MediaSize::Unknown);
    }

    #[test]
    fn a_pdf_token_split_across_reads_is_still_read() {
        // The decoder hands out under a kilobyte at a time, so these offsets put every
        // byte of a token and of `endstream` at the end of some read.
        for offset in 1000..2600 {
            let mut doc = b"%PDF-1.7\n%".to_vec();
            doc.resize(offset, b'x');
            doc.extend_from_slice(b"\n2 0 obj\n<< /Type /Pages /Count 12 >>\nendobj\n");
            assert_eq!(sniff(&b64(&doc)), pages(12), "split at {offset}");
            // Near-misses inside a stream body do not end it.
            let mut doc = b"%PDF-1.7\n1 0 obj << /Length 99 >> stream\n".to_vec();
            doc.extend_from_slice(b"m mm endstrea m ndstream stream am /Type /Pages /Count 3");
            doc.resize(offset, b'm');
            doc.extend_from_slice(b"endstream endobj\n2 0 obj << /Type /Pages /Count 12 >>\n");
            assert_eq!(sniff(&b64(&doc)), pages(12), "split at {offset}");
        }
        // And a large PDF is read to its end.
        let mut doc = b"%PDF-1.7\n9 0 obj << /Length 1 >> stream\n".to_vec();
        doc.extend(XorShift(23).bytes(300_000));
        doc.extend_from_slice(
            b"\nendstream endobj\n3 0 obj << /Type /Pages /Count 250 >> endobj\n",
        );
        assert_eq!(sniff(&b64(&doc)), pages(250));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let prefixes: [&[u8]; 10] = [
            b"%PDF-1.5\n1 0 obj << /Type /ObjStm /Filter /FlateDecode >> stream\n\x78\x9c",
            b"%PDF-1.5\n1 0 obj << /Type /ObjStm /Filter /FlateDecode >> stream\n\x78\x01\x05",
            b"",
            &PNG_SIGNATURE,
            &[0xFF, 0xD8],
            b"GIF89a",
            b"RIFF\0\0\0\0WEBPVP8",
            b"BM",
            b"%PDF-1.4\n",
            b"%PDF-1.4\n<< /Type /Pages /Count ",
        ];
        for round in 0..3_000 {
            let len = rng.below(300) as usize;
            check(&sniff(&b64(
                &[prefixes[round % 10], &rng.bytes(len)].concat()
            )));
            // Random text, most of it not base64 at all.
            let text: String = (0..rng.below(64))
                .map(|_| char::from(rng.below(128) as u8))
                .collect();
            check(&sniff(&text));
        }
        // Real headers with one byte flipped.
        let samples = [
            png_header(64, 64),
            jpeg_640x480(),
            gif(10, 20),
            webp_lossy(400, 300),
            webp_lossless(1000, 750),
            webp_extended(500, 400),
            sample_pdf(3, true),
            pdf_with_object_stream("/Filter /FlateDecode", &zlib(&page_tree_objects(), 9)),
        ];
        for sample in &samples {
            for _ in 0..200 {
                let mut bytes = sample.clone();
                let at = rng.below(bytes.len() as u64) as usize;
                bytes[at] ^= 1 << rng.below(8);
                check(&sniff(&b64(&bytes)));
            }
        }

        fn check(size: &MediaSize) {
            match *size {
                MediaSize::Image { width, height } => assert!(width > 0 && height > 0),
                MediaSize::Pdf { pages } => assert!(pages > 0),
                MediaSize::Unknown => {}
            }
        }
    }

    #[test]
    fn anthropic_follows_its_published_examples() {
        // 1,048,576 / 750 = 1,398.1, rounded up as the doc's own table rounds: 1092x1092
        // is ~1,590 and 1000x1000 ~1,334. 200x200 is ~54 by area but 8 x 8 = 64 by 28 px
        // patches; the larger is reserved.
        let examples = [
            (1024, 1024, 1_399),
            (1092, 1092, 1_590),
            (1000, 1000, 1_334),
        ];
        for (w, h, tokens) in examples.into_iter().chain([(200, 200, 64), (1, 1, 1)]) {
            assert_eq!(anthropic_image_tokens(w, h), tokens, "{w}x{h}");
        }
        // A 12 MP photo is scaled down to about 1.2 MP first.
        let big = anthropic_image_tokens(4000, 3000);
        assert!((1_550..=ANTHROPIC_MAX_IMAGE_TOKENS).contains(&big), "{big}");
        let huge = anthropic_image_tokens(8000, 8000);
        assert!(
            (1_590..=ANTHROPIC_MAX_IMAGE_TOKENS).contains(&huge),
            "{huge}"
        );
        assert_eq!(anthropic_image_tokens(0, 10), ANTHROPIC_MAX_IMAGE_TOKENS);
        // A long edge over 1568 px is brought down even when the area is small.
        let tokens = anthropic_image_tokens;
        assert_eq!(tokens(8000, 28), tokens(1568, 5));
    }

    #[test]
    fn anthropic_high_resolution_tier() {
        let high_res = "claude-opus-4-7 claude-opus-4-7-20260416 claude-opus-4-8 claude-sonnet-5 \
            anthropic/claude-opus-5-1 claude-opus-4-latest some-alias";
        for model in high_res.split_whitespace() {
            let most = anthropic_max_image_tokens_for(model);
            assert_eq!(most, ANTHROPIC_HIGH_RES_MAX_IMAGE_TOKENS, "{model}");
        }
        let standard =
            "claude-3-5-sonnet-20241022 claude-3-opus-20240229 claude-sonnet-4-20250514 \
            claude-opus-4-1@20250805 us.anthropic.claude-3-7-sonnet-20250219-v1:0 \
            claude-haiku-4-5 claude-sonnet-4-6 Claude-Opus-4-6";
        for model in standard.split_whitespace() {
            let most = anthropic_max_image_tokens_for(model);
            assert_eq!(most, ANTHROPIC_MAX_IMAGE_TOKENS, "{model}");
        }
        let tokens_for = anthropic_image_tokens_for;
        assert_eq!(tokens_for("claude-opus-4-7", 1024, 1024), 1_399);
        let big = tokens_for("claude-opus-4-7", 4000, 3000);
        assert!(
            (4_700..=ANTHROPIC_HIGH_RES_MAX_IMAGE_TOKENS).contains(&big),
            "{big}"
        );
        let standard = anthropic_image_tokens(4000, 3000);
        assert_eq!(tokens_for("claude-sonnet-4-5", 4000, 3000), standard);
    }

    #[test]
    fn pdf_pages_cost_text_and_an_image_each() {
        assert_eq!(PDF_PAGE_TOKENS, 4_600);
        assert_eq!(pdf_tokens(3), 13_800);
        assert_eq!(pdf_tokens(UNSIZED_DOCUMENT_PAGES), 46_000);
        assert_eq!(pdf_tokens(u32::MAX), u64::from(u32::MAX) * 4_600);
        assert_eq!(pdf_tokens_for("claude-opus-4-7", 2), 16_000);
        assert_eq!(
            pdf_tokens_for("claude-3-5-sonnet-20241022", 2),
            pdf_tokens(2)
        );
    }

    #[test]
    fn openai_follows_its_published_examples() {
        for (model, w, h, detail, tokens) in [
            // The tile rule.
            ("gpt-4o", 1024, 1024, High, 765),
            ("gpt-4o", 1024, 1024, Auto, 765),
            ("gpt-4o", 2048, 4096, High, 1_105),
            ("gpt-4o", 4096, 8192, Low, 85),
            ("gpt-4o", 512, 512, High, 255),
            ("gpt-4o", 0, 10, High, 1_445),
            ("gpt-4o-mini", 1024, 1024, High, 2_833 + 5_667 * 4),
            ("gpt-4o-mini", 10, 10, Low, 2_833),
            ("o1", 1024, 1024, High, 75 + 150 * 4),
            ("gpt-5", 1024, 1024, High, 70 + 140 * 4),
            ("computer-use-preview", 1024, 1024, High, 65 + 129 * 4),
            // On a tile model an unknown detail is `high`, the costliest it has.
            ("gpt-4o", 1024, 1024, Original, 765),
            // The patch rule: 1024x1024 is 32 x 32 = 1,024 patches, under every budget.
            ("gpt-4.1-mini", 1024, 1024, High, 1_659),
            ("gpt-4.1-nano", 1024, 1024, High, 2_520),
            ("o4-mini", 1024, 1024, High, 1_762),
            // 1800x2400 is 4,275 patches, shrunk to 1056x1408 = 1,452 in a 1,536 budget.
            ("o4-mini", 1800, 2400, High, (1_452u64 * 172).div_ceil(100)),
            // gpt-5.4 at high: 1024x1024 is ceil(1024 x 1.2) = 1,229; 2048x2048 is shrunk to
            // 1600x1600 = 2,500 patches, 3,000 tokens; `auto` sizes as `high`.
            ("gpt-5.4", 1024, 1024, High, 1_229),
            ("gpt-5.4", 2048, 2048, High, 3_000),
            ("gpt-5.4", 2048, 2048, Auto, 3_000),
            // On gpt-5.6 `original` (which `auto` is) has no budget at all: 128 x 128
            // patches at 1.2.
            ("gpt-5.6-sol", 4096, 4096, Auto, 19_661),
        ] {
            let got = openai_image_tokens(model, w, h, detail);
            assert_eq!(got, tokens, "{model} {w}x{h} {detail:?}");
        }
        assert_eq!(patches(1800, 2400, limit(2048, 1_536)), 1_452);
        // On gpt-5.4, `low` has the larger budget.
        let at = |detail| openai_image_tokens("gpt-5.4", 2048, 2048, detail);
        assert!(at(Low) > at(High));
        for (model, detail, most) in [
            ("gpt-4o", High, 85 + 170 * 8),
            ("gpt-4o", Low, 85),
            // On gpt-5.5 `auto` is `original`: 6000 px and 10,000 patches.
            ("gpt-5.5", Auto, 12_000),
            ("gpt-5.5", Low, 308),
            // Never above the budget, whatever the shape.
            ("gpt-4.1-nano", High, 3_779),
            ("gpt-4.1-mini", High, 6_636),
        ] {
            let got = openai_max_image_tokens(model, detail);
            assert_eq!(got, most, "{model} {detail:?}");
        }
    }

    #[test]
    fn openai_models_match_by_family() {
        for (model, tokens) in [
            ("gpt-4o-mini-2024-07-18", 25_501),
            ("openai/gpt-4o-mini", 25_501),
            ("ft:gpt-4o-mini-2024-07-18:acme::abc123", 25_501),
            ("gpt-4o-2024-08-06", 765),
            ("azure/gpt-4o", 765),
            ("GPT-4o", 765),
            ("gpt-4.1-2025-04-14", 765),
            ("gpt-4.1-mini-2025-04-14", 1_659),
            ("gpt-4.1-nano", 2_520),
            ("gpt-4.5-preview", 765),
            ("gpt-4-turbo-2024-04-09", 765),
            ("gpt-5-2025-08-07", 630),
            ("gpt-5-chat-latest", 630),
            ("gpt-5-mini-2025-08-07", 1_659),
            ("gpt-5-nano", 2_520),
            ("gpt-5.1", 630),
            ("gpt-5.1-codex-mini", 1_659),
            ("gpt-5.2-chat-latest", 1_229),
            ("gpt-5.4-mini", 1_659),
            ("o1-pro", 675),
            ("o3-2025-04-16", 675),
            ("o4-mini-2025-04-16", 1_762),
            // Unknown models take the default tile rule.
            ("some-new-model", 765),
            ("gpt-5.10", 765),
            ("", 765),
        ] {
            assert_eq!(
                openai_image_tokens(model, 1024, 1024, High),
                tokens,
                "{model}"
            );
        }
    }

    #[test]
    fn detail_is_read_from_the_request() {
        assert_eq!(Detail::from_param(None), Auto);
        let values = [
            ("low", Low),
            (" HIGH ", High),
            ("auto", Auto),
            ("original", Original),
        ];
        for (value, detail) in values.into_iter().chain([("ultra", Original)]) {
            assert_eq!(Detail::from_param(Some(value)), detail, "{value}");
        }
    }

    #[test]
    fn no_image_costs_more_than_the_maximum() {
        let mut rng = XorShift(42);
        let models = "gpt-4o gpt-4o-mini gpt-4.1-mini gpt-4.1-nano o4-mini gpt-5 gpt-5-mini \
            gpt-5.2 gpt-5.4 gpt-5.4-nano gpt-5.5 gpt-5.6-luna unknown";
        let sides = [
            1, 31, 32, 33, 511, 512, 513, 767, 768, 2047, 2048, 2049, 70_000,
        ];
        for _ in 0..5_000 {
            let mut pick = || match rng.below(3) {
                0 => sides[rng.below(sides.len() as u64) as usize],
                1 => rng.below(4096) as u32 + 1,
                _ => rng.next() as u32,
            };
            let (w, h) = (pick(), pick());
            for model in models.split_whitespace() {
                for detail in [Low, High, Auto, Original] {
                    let tokens = openai_image_tokens(model, w, h, detail);
                    let most = openai_max_image_tokens(model, detail);
                    assert!(
                        (1..=most).contains(&tokens),
                        "{model} {detail:?} {w}x{h}: {tokens}"
                    );
                }
            }
            let tokens = anthropic_image_tokens(w, h);
            assert!(
                (1..=ANTHROPIC_MAX_IMAGE_TOKENS).contains(&tokens),
                "{w}x{h}"
            );
            let tokens = anthropic_image_tokens_for("claude-opus-4-7", w, h);
            assert!((1..=ANTHROPIC_HIGH_RES_MAX_IMAGE_TOKENS).contains(&tokens));
        }
    }
}
