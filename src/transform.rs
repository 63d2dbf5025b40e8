//! How does a wire array become an engine buffer? Element conversion between a wire array and an
//! engine buffer, in one pass.
//!
//! Every binding compiles (at start-up) into a [`Transform`]: an index map (identity, an axis
//! permutation such as HWC→CHW, or a column slice) and an affine map `y = x·a + b` whose
//! coefficients may vary along the wire tensor (per-element normalisation with openpi's norm
//! stats). Applying it reads each source element once and writes each destination element
//! once; nothing is allocated.

use crate::dtype::{ByteOrder, ElemType};

/// An element type that can be loaded from and stored to bytes.
trait Elem: Copy {
    const SIZE: usize;
    fn load(b: &[u8], order: ByteOrder) -> Self;
    fn store(self, b: &mut [u8]);
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! num_elem {
    ($t:ty, $n:expr) => {
        impl Elem for $t {
            const SIZE: usize = $n;
            #[inline(always)]
            fn load(b: &[u8], order: ByteOrder) -> Self {
                let mut a = [0u8; $n];
                a.copy_from_slice(&b[..$n]);
                match order {
                    ByteOrder::Little => <$t>::from_le_bytes(a),
                    ByteOrder::Big => <$t>::from_be_bytes(a),
                }
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b[..$n].copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                // `as` saturates and maps NaN to 0 for integers: no UB, no panic.
                v as $t
            }
        }
    };
}
num_elem!(u8, 1);
num_elem!(i8, 1);
num_elem!(u16, 2);
num_elem!(i16, 2);
num_elem!(u32, 4);
num_elem!(i32, 4);
num_elem!(u64, 8);
num_elem!(i64, 8);
num_elem!(f32, 4);
num_elem!(f64, 8);

/// numpy's bool: one byte, 0 or 1 (anything else read as true).
#[derive(Clone, Copy)]
struct Bool(bool);
impl Elem for Bool {
    const SIZE: usize = 1;
    fn load(b: &[u8], _: ByteOrder) -> Self {
        Bool(b[0] != 0)
    }
    fn store(self, b: &mut [u8]) {
        b[0] = u8::from(self.0);
    }
    fn to_f64(self) -> f64 {
        if self.0 { 1.0 } else { 0.0 }
    }
    fn from_f64(v: f64) -> Self {
        Bool(v != 0.0)
    }
}

#[derive(Clone, Copy)]
struct F16(half::f16);
impl Elem for F16 {
    const SIZE: usize = 2;
    fn load(b: &[u8], order: ByteOrder) -> Self {
        F16(half::f16::from_bits(u16::load(b, order)))
    }
    fn store(self, b: &mut [u8]) {
        self.0.to_bits().store(b)
    }
    fn to_f64(self) -> f64 {
        self.0.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        F16(half::f16::from_f64(v))
    }
}

/// A nonlinear map of one input feature, between the binding's `scale`/`offset` and its
/// normalisation (`[[inputs]] map`): what no affine map can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeatureMap {
    /// openpi's ALOHA `_gripper_to_angular` (`aloha_policy.py`, `adapt_to_pi`): the gripper's
    /// normalised linear position to metres, to the servo horn's angle (arcsin of the law of
    /// cosines, clipped), normalised to the pi runtime's range. Monotone only for positions
    /// above zero metres; computed as numpy computes it, so every input gets openpi's value.
    AlohaGripperToAngular,
}

impl FeatureMap {
    /// The config's names, for `[[inputs]] map.function`.
    pub const NAMES: [(&'static str, FeatureMap); 1] = [(
        "aloha_gripper_to_angular",
        FeatureMap::AlohaGripperToAngular,
    )];

    pub fn parse(name: &str) -> Option<FeatureMap> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, m)| m)
    }

    pub fn apply(self, x: f64) -> f64 {
        match self {
            FeatureMap::AlohaGripperToAngular => {
                // `_unnormalize(x, 0.01844, 0.05800)`, `linear_to_radian(·, arm_length =
                // 0.036, horn_radius = 0.022)`, `_normalize(·, 0.5476, 1.6296)`, in openpi's
                // order of operations.
                let (horn, arm) = (0.022f64, 0.036f64);
                let v = x * (0.05800 - 0.01844) + 0.01844;
                let c = (horn * horn + v * v - arm * arm) / (2.0 * horn * v);
                let angle = c.clamp(-1.0, 1.0).asin();
                (angle - 0.5476) / (1.6296 - 0.5476)
            }
        }
    }
}

/// `y = x·a + b`, with coefficients that are constant or vary along the wire tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Affine {
    /// Constant coefficients (`a = 1, b = 0` is a plain cast).
    Scalar { a: f64, b: f64 },
    /// Coefficient `k` applies to wire element `i` where `k = i % a.len()`: a length equal to
    /// the wire tensor's last axis gives per-feature normalisation (state dimensions, image
    /// channels in HWC); a length equal to the element count gives per-element coefficients.
    Indexed { a: Vec<f64>, b: Vec<f64> },
    /// `Indexed`, with a nonlinear map before some features' normalisation: feature `k`'s
    /// `y = g(x·s + o)·a[k] + b[k]` where `maps[k]` is `Some((g, s, o))` (one entry per
    /// feature of the wire tensor's last axis).
    Mapped {
        a: Vec<f64>,
        b: Vec<f64>,
        maps: Vec<Option<(FeatureMap, f64, f64)>>,
    },
}

impl Affine {
    pub const IDENTITY: Affine = Affine::Scalar { a: 1.0, b: 0.0 };

    /// openpi's normalisation of an input, `((x·scale + offset) − mean) / (std + eps)` (openpi's
    /// `eps` is 1e-6, LeRobot's 1e-8; LeRobot's min/max arrive resolved into mean/std).
    pub fn normalize(scale: f64, offset: f64, mean: &[f64], std: &[f64], eps: f64) -> Affine {
        if mean.is_empty() {
            return Affine::Scalar {
                a: scale,
                b: offset,
            };
        }
        let (a, b) = mean
            .iter()
            .zip(std)
            .map(|(m, s)| {
                let inv = 1.0 / (s + eps);
                (scale * inv, (offset - m) * inv)
            })
            .unzip();
        Affine::Indexed { a, b }
    }

    /// An input's map, `((g(x·scale + offset)) − mean) / (std + eps)`, per feature of a wire
    /// tensor whose last axis has `features` values: `scale`, `offset`, `mean` and `std` each
    /// hold one value or one per feature (per-element statistics take
    /// [`Affine::normalize`]); `g` is `map`'s function on its features, the identity elsewhere.
    pub fn per_feature(
        features: usize,
        scale: &[f64],
        offset: &[f64],
        mean: &[f64],
        std: &[f64],
        eps: f64,
        map: Option<(FeatureMap, &[usize])>,
    ) -> Affine {
        let at = |v: &[f64], k: usize, default: f64| match v.len() {
            0 => default,
            1 => v[0],
            _ => v[k],
        };
        let mut a = Vec::with_capacity(features);
        let mut b = Vec::with_capacity(features);
        let mut maps = vec![None; features];
        for (k, slot) in maps.iter_mut().enumerate() {
            let (s, o) = (at(scale, k, 1.0), at(offset, k, 0.0));
            let inv = if mean.is_empty() {
                1.0
            } else {
                1.0 / (at(std, k, 1.0) + eps)
            };
            let m = at(mean, k, 0.0);
            match map {
                Some((g, columns)) if columns.contains(&k) => {
                    *slot = Some((g, s, o));
                    a.push(inv);
                    b.push(-m * inv);
                }
                _ => {
                    a.push(s * inv);
                    b.push((o - m) * inv);
                }
            }
        }
        if maps.iter().any(Option::is_some) {
            Affine::Mapped { a, b, maps }
        } else {
            Affine::Indexed { a, b }
        }
    }

    /// Wire element `i`'s `y` for `x` (`i` indexes the coefficients modulo their count).
    #[inline(always)]
    fn at(&self, i: usize, x: f64) -> f64 {
        match self {
            Affine::Scalar { a, b } => x * a + b,
            Affine::Indexed { a, b } => {
                let k = i % a.len();
                x * a[k] + b[k]
            }
            Affine::Mapped { a, b, maps } => {
                let k = i % a.len();
                match maps[k] {
                    Some((g, s, o)) => g.apply(x * s + o) * a[k] + b[k],
                    None => x * a[k] + b[k],
                }
            }
        }
    }

    /// The value before normalisation that gave `y` at wire element `i` (after a feature's
    /// map, where it has one: the map is not inverted).
    pub fn before_normalising(&self, i: usize, y: f64) -> f64 {
        match self {
            Affine::Scalar { a, b } => (y - b) / a,
            Affine::Indexed { a, b } | Affine::Mapped { a, b, .. } => {
                let k = i % a.len();
                (y - b[k]) / a[k]
            }
        }
    }

    /// How many coefficient sets (the lookup table's).
    fn sets(&self) -> usize {
        match self {
            Affine::Scalar { .. } => 1,
            Affine::Indexed { a, .. } | Affine::Mapped { a, .. } => a.len(),
        }
    }

    /// The un-normalisation of an output: `x · (std + eps) + mean` (openpi's `Unnormalize`
    /// with eps 1e-6; LeRobot's with 0).
    pub fn unnormalize(mean: &[f64], std: &[f64], eps: f64) -> Affine {
        if mean.is_empty() {
            return Affine::IDENTITY;
        }
        let (a, b) = mean.iter().zip(std).map(|(m, s)| (s + eps, *m)).unzip();
        Affine::Indexed { a, b }
    }

    fn is_identity(&self) -> bool {
        matches!(self, Affine::Scalar { a, b } if *a == 1.0 && *b == 0.0)
    }
}

/// Which side of a transform is the wire tensor (affine coefficients are indexed on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireSide {
    Source,
    Destination,
}

/// A compiled element map from a source tensor to a destination tensor.
///
/// The index map is given as the destination's dimensions and, for each destination axis, the
/// stride of that axis in the source (in elements): HWC→CHW of `[H, W, C]` is dims `[C, H, W]`,
/// strides `[1, W·C, C]`; taking the first `n` columns of `[H, D]` is dims `[H, n]`,
/// strides `[D, 1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Transform {
    pub src_type: ElemType,
    pub dst_type: ElemType,
    /// Destination dimensions (row-major).
    pub dims: Vec<usize>,
    /// Source stride of each destination axis.
    pub src_strides: Vec<usize>,
    /// True when the index map is the identity (destination index == source index).
    pub contiguous: bool,
    /// Elements read from the source.
    pub src_len: usize,
    pub affine: Affine,
    pub wire_side: WireSide,
    /// For one-byte sources (camera images): every possible result, precomputed at start-up,
    /// `256 · dst_size` bytes per coefficient set, so an image pixel costs a table lookup
    /// instead of a float multiply-add and cast. Results are bit-identical to the direct path.
    lut: Vec<u8>,
}

/// Largest number of coefficient sets given a lookup table (per-channel stats are ≤ 4; a
/// per-element map over a whole image would make the table larger than the image).
const MAX_LUT_SETS: usize = 16;

impl Transform {
    /// A transform whose index map is the identity over `len` elements.
    pub fn elementwise(src_type: ElemType, dst_type: ElemType, len: usize, affine: Affine) -> Self {
        Transform {
            src_type,
            dst_type,
            dims: vec![len],
            src_strides: vec![1],
            contiguous: true,
            src_len: len,
            affine,
            wire_side: WireSide::Source,
            lut: Vec::new(),
        }
        .with_lut()
    }

    /// A transform that permutes the axes of a source of shape `src_shape`: destination axis
    /// `k` is source axis `perm[k]`.
    pub fn permuted(
        src_type: ElemType,
        dst_type: ElemType,
        src_shape: &[usize],
        perm: &[usize],
        affine: Affine,
    ) -> Self {
        let strides = row_major_strides(src_shape);
        let dims: Vec<usize> = perm.iter().map(|&p| src_shape[p]).collect();
        let src_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
        let contiguous = perm.iter().enumerate().all(|(i, &p)| i == p);
        Transform {
            src_type,
            dst_type,
            src_len: src_shape.iter().product(),
            contiguous,
            dims,
            src_strides,
            affine,
            wire_side: WireSide::Source,
            lut: Vec::new(),
        }
        .with_lut()
    }

    /// A transform that keeps the first `cols` entries of the last axis of `src_shape`.
    pub fn first_columns(
        src_type: ElemType,
        dst_type: ElemType,
        src_shape: &[usize],
        cols: usize,
        affine: Affine,
    ) -> Self {
        let strides = row_major_strides(src_shape);
        let mut dims = src_shape.to_vec();
        let last = dims.len().saturating_sub(1);
        let contiguous = dims.get(last).is_none_or(|&d| d == cols);
        if let Some(d) = dims.get_mut(last) {
            *d = cols;
        }
        Transform {
            src_type,
            dst_type,
            src_len: src_shape.iter().product(),
            contiguous,
            dims,
            src_strides: strides,
            affine,
            wire_side: WireSide::Destination,
            lut: Vec::new(),
        }
        .with_lut()
    }

    /// Builds the lookup table where it pays (see [`Transform::lut`]).
    fn with_lut(mut self) -> Self {
        let sets = self.affine.sets();
        let byte_source = matches!(self.src_type, ElemType::U8 | ElemType::I8);
        // A contiguous map with constant coefficients vectorises, which beats a table gather.
        let vectorises = self.contiguous && sets == 1;
        if !byte_source || vectorises || sets > MAX_LUT_SETS || self.src_len < 256 * sets {
            return self;
        }
        let size = self.dst_type.size();
        let mut lut = vec![0u8; sets * 256 * size];
        let mut src = [0u8; 1];
        for k in 0..sets {
            for byte in 0..256usize {
                src[0] = byte as u8;
                let x = load_f64(self.src_type, &src, 0);
                let at = (k * 256 + byte) * size;
                fill_bytes(self.dst_type, self.affine.at(k, x), &mut lut[at..at + size]);
            }
        }
        self.lut = lut;
        self
    }

    /// Elements written to the destination.
    pub fn dst_len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Bytes written to the destination.
    pub fn dst_bytes(&self) -> usize {
        self.dst_len() * self.dst_type.size()
    }

    /// Converts `src` (exactly `src_len` elements of `src_type` in `order`) into `dst`
    /// (exactly `dst_bytes()` bytes). Lengths are checked by the caller; a mismatch here is a
    /// bug, reported as `false` rather than a panic.
    pub fn apply(&self, src: &[u8], order: ByteOrder, dst: &mut [u8]) -> bool {
        if src.len() != self.src_len * self.src_type.size() || dst.len() != self.dst_bytes() {
            return false;
        }
        if self.contiguous
            && self.src_type == self.dst_type
            && self.affine.is_identity()
            && (order == ByteOrder::Little || self.src_type.size() == 1)
        {
            dst.copy_from_slice(src);
            return true;
        }
        if !self.lut.is_empty() {
            match self.dst_type.size() {
                1 => run_lut::<1>(self, src, dst),
                2 => run_lut::<2>(self, src, dst),
                4 => run_lut::<4>(self, src, dst),
                _ => run_lut::<8>(self, src, dst),
            }
            return true;
        }
        dispatch_src(self, src, order, dst);
        true
    }

    /// Fills the destination with `value` (cast to the destination type, no affine map).
    pub fn fill(&self, value: f64, dst: &mut [u8]) {
        fill_bytes(self.dst_type, value, dst)
    }
}

/// Clamps element `i` of `dst` (`t` values, little-endian) to `bounds[i % bounds.len()]`.
pub fn clamp(t: ElemType, dst: &mut [u8], bounds: &[(f64, f64)]) {
    if bounds.is_empty() {
        return;
    }
    match t {
        ElemType::F32 => {
            for (i, e) in dst.chunks_exact_mut(4).enumerate() {
                let (lo, hi) = bounds[i % bounds.len()];
                let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                e.copy_from_slice(&x.clamp(lo as f32, hi as f32).to_le_bytes());
            }
        }
        ElemType::F64 => {
            for (i, e) in dst.chunks_exact_mut(8).enumerate() {
                let (lo, hi) = bounds[i % bounds.len()];
                let mut b = [0u8; 8];
                b.copy_from_slice(e);
                e.copy_from_slice(&f64::from_le_bytes(b).clamp(lo, hi).to_le_bytes());
            }
        }
        _ => {}
    }
}

/// Fills a buffer of `ty` elements with `value`.
pub fn fill_bytes(ty: ElemType, value: f64, dst: &mut [u8]) {
    macro_rules! go {
        ($t:ty) => {{
            let v = <$t>::from_f64(value);
            for c in dst.chunks_exact_mut(<$t>::SIZE) {
                v.store(c);
            }
        }};
    }
    match ty {
        ElemType::Bool => go!(Bool),
        ElemType::U8 => go!(u8),
        ElemType::I8 => go!(i8),
        ElemType::U16 => go!(u16),
        ElemType::I16 => go!(i16),
        ElemType::U32 => go!(u32),
        ElemType::I32 => go!(i32),
        ElemType::U64 => go!(u64),
        ElemType::I64 => go!(i64),
        ElemType::F16 => go!(F16),
        ElemType::F32 => go!(f32),
        ElemType::F64 => go!(f64),
    }
}

/// Whether every element of a buffer of `ty` in `order` is finite (no NaN, no infinity);
/// integers always are.
pub fn all_finite(ty: ElemType, bytes: &[u8], order: ByteOrder) -> bool {
    fn check<T: Elem>(bytes: &[u8], order: ByteOrder) -> bool {
        bytes
            .chunks_exact(T::SIZE)
            .all(|c| T::load(c, order).to_f64().is_finite())
    }
    match ty {
        ElemType::F16 => check::<F16>(bytes, order),
        ElemType::F32 => check::<f32>(bytes, order),
        ElemType::F64 => check::<f64>(bytes, order),
        _ => true,
    }
}

/// Reads element `i` of a buffer of `ty` as f64 (for checks such as finiteness).
pub fn load_f64(ty: ElemType, bytes: &[u8], i: usize) -> f64 {
    load_f64_ordered(ty, &bytes[i * ty.size()..], ByteOrder::Little)
}

/// The first element of `b`, of type `ty` stored in `order`, as f64.
pub fn load_f64_ordered(ty: ElemType, b: &[u8], order: ByteOrder) -> f64 {
    match ty {
        ElemType::Bool => Bool::load(b, order).to_f64(),
        ElemType::U8 => u8::load(b, order).to_f64(),
        ElemType::I8 => i8::load(b, order).to_f64(),
        ElemType::U16 => u16::load(b, order).to_f64(),
        ElemType::I16 => i16::load(b, order).to_f64(),
        ElemType::U32 => u32::load(b, order).to_f64(),
        ElemType::I32 => i32::load(b, order).to_f64(),
        ElemType::U64 => u64::load(b, order).to_f64(),
        ElemType::I64 => i64::load(b, order).to_f64(),
        ElemType::F16 => F16::load(b, order).to_f64(),
        ElemType::F32 => f32::load(b, order).to_f64(),
        ElemType::F64 => f64::load(b, order).to_f64(),
    }
}

/// Row-major strides (in elements) of a shape.
pub fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

fn dispatch_src(t: &Transform, src: &[u8], order: ByteOrder, dst: &mut [u8]) {
    match t.src_type {
        ElemType::Bool => dispatch_dst::<Bool>(t, src, order, dst),
        ElemType::U8 => dispatch_dst::<u8>(t, src, order, dst),
        ElemType::I8 => dispatch_dst::<i8>(t, src, order, dst),
        ElemType::U16 => dispatch_dst::<u16>(t, src, order, dst),
        ElemType::I16 => dispatch_dst::<i16>(t, src, order, dst),
        ElemType::U32 => dispatch_dst::<u32>(t, src, order, dst),
        ElemType::I32 => dispatch_dst::<i32>(t, src, order, dst),
        ElemType::U64 => dispatch_dst::<u64>(t, src, order, dst),
        ElemType::I64 => dispatch_dst::<i64>(t, src, order, dst),
        ElemType::F16 => dispatch_dst::<F16>(t, src, order, dst),
        ElemType::F32 => dispatch_dst::<f32>(t, src, order, dst),
        ElemType::F64 => dispatch_dst::<f64>(t, src, order, dst),
    }
}

fn dispatch_dst<S: Elem>(t: &Transform, src: &[u8], order: ByteOrder, dst: &mut [u8]) {
    match t.dst_type {
        ElemType::Bool => run::<S, Bool>(t, src, order, dst),
        ElemType::U8 => run::<S, u8>(t, src, order, dst),
        ElemType::I8 => run::<S, i8>(t, src, order, dst),
        ElemType::U16 => run::<S, u16>(t, src, order, dst),
        ElemType::I16 => run::<S, i16>(t, src, order, dst),
        ElemType::U32 => run::<S, u32>(t, src, order, dst),
        ElemType::I32 => run::<S, i32>(t, src, order, dst),
        ElemType::U64 => run::<S, u64>(t, src, order, dst),
        ElemType::I64 => run::<S, i64>(t, src, order, dst),
        ElemType::F16 => run::<S, F16>(t, src, order, dst),
        ElemType::F32 => run::<S, f32>(t, src, order, dst),
        ElemType::F64 => run::<S, f64>(t, src, order, dst),
    }
}

#[inline(always)]
fn run<S: Elem, D: Elem>(t: &Transform, src: &[u8], order: ByteOrder, dst: &mut [u8]) {
    if t.contiguous {
        let pairs = src.chunks_exact(S::SIZE).zip(dst.chunks_exact_mut(D::SIZE));
        match &t.affine {
            Affine::Scalar { a, b } => {
                let (a, b) = (*a, *b);
                for (s, d) in pairs {
                    D::from_f64(S::load(s, order).to_f64() * a + b).store(d);
                }
            }
            affine => {
                for (i, (s, d)) in pairs.enumerate() {
                    D::from_f64(affine.at(i, S::load(s, order).to_f64())).store(d);
                }
            }
        }
        return;
    }
    // Odometer over the destination; the innermost axis advances the source by its stride.
    let rank = t.dims.len();
    let inner = t.dims[rank - 1];
    let inner_stride = t.src_strides[rank - 1];
    let outer: usize = t.dims[..rank - 1].iter().product();
    let mut idx = [0usize; crate::limits::MAX_RANK];
    let mut d_i = 0usize;
    for _ in 0..outer {
        let base: usize = (0..rank - 1).map(|k| idx[k] * t.src_strides[k]).sum();
        for j in 0..inner {
            let s_i = base + j * inner_stride;
            let wire = match t.wire_side {
                WireSide::Source => s_i,
                WireSide::Destination => d_i,
            };
            let v = t
                .affine
                .at(wire, S::load(&src[s_i * S::SIZE..], order).to_f64());
            D::from_f64(v).store(&mut dst[d_i * D::SIZE..]);
            d_i += 1;
        }
        for k in (0..rank - 1).rev() {
            idx[k] += 1;
            if idx[k] < t.dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// [`run`] for one-byte sources through the lookup table; `N` is the destination size.
fn run_lut<const N: usize>(t: &Transform, src: &[u8], dst: &mut [u8]) {
    let (lut, _) = t.lut.as_chunks::<N>();
    let (out, _) = dst.as_chunks_mut::<N>();
    let sets = lut.len() / 256;
    if t.contiguous {
        if sets == 1 {
            for (o, &s) in out.iter_mut().zip(src) {
                *o = lut[s as usize];
            }
        } else {
            for (i, (o, &s)) in out.iter_mut().zip(src).enumerate() {
                *o = lut[(i % sets) * 256 + s as usize];
            }
        }
        return;
    }
    let rank = t.dims.len();
    let inner = t.dims[rank - 1];
    let stride = t.src_strides[rank - 1];
    if rank >= 2 && inner < 8 && t.dims[rank - 2] > inner {
        run_lut_short_rows(t, lut, src, out, sets);
        return;
    }
    let mut idx = [0usize; crate::limits::MAX_RANK];
    for (row, out_row) in out.chunks_exact_mut(inner.max(1)).enumerate() {
        let base: usize = (0..rank - 1).map(|k| idx[k] * t.src_strides[k]).sum();
        let wire_base = match t.wire_side {
            WireSide::Source => base,
            WireSide::Destination => row * inner,
        };
        let wire_step = match t.wire_side {
            WireSide::Source => stride,
            WireSide::Destination => 1,
        };
        let row_src = &src[base..];
        if sets == 1 || wire_step % sets == 0 {
            // One coefficient set for the whole row (e.g. a channel plane of HWC→CHW).
            let table = &lut[(wire_base % sets) * 256..][..256];
            for (o, s) in out_row
                .iter_mut()
                .zip(row_src.iter().step_by(stride.max(1)))
            {
                *o = table[*s as usize];
            }
        } else {
            for (j, (o, s)) in out_row
                .iter_mut()
                .zip(row_src.iter().step_by(stride.max(1)))
                .enumerate()
            {
                *o = lut[((wire_base + j * wire_step) % sets) * 256 + *s as usize];
            }
        }
        for k in (0..rank - 1).rev() {
            idx[k] += 1;
            if idx[k] < t.dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// [`run_lut`] for a short innermost axis (CHW→HWC ends in 3 channels): the two innermost
/// axes are walked with the longer one inside, so each inner loop runs a row of pixels
/// (reading consecutive source bytes) instead of 3 elements with a row's set-up around them.
fn run_lut_short_rows<const N: usize>(
    t: &Transform,
    lut: &[[u8; N]],
    src: &[u8],
    out: &mut [[u8; N]],
    sets: usize,
) {
    let rank = t.dims.len();
    let (inner, mid) = (t.dims[rank - 1], t.dims[rank - 2]);
    let (stride, mid_stride) = (t.src_strides[rank - 1], t.src_strides[rank - 2]);
    let block = inner * mid;
    let mut idx = [0usize; crate::limits::MAX_RANK];
    for (b, out_block) in out.chunks_exact_mut(block.max(1)).enumerate() {
        let base: usize = (0..rank - 2).map(|k| idx[k] * t.src_strides[k]).sum();
        for c in 0..inner {
            let first = base + c * stride;
            if sets == 1 {
                for m in 0..mid {
                    out_block[m * inner + c] = lut[src[first + m * mid_stride] as usize];
                }
                continue;
            }
            for m in 0..mid {
                let wire = match t.wire_side {
                    WireSide::Source => first + m * mid_stride,
                    WireSide::Destination => b * block + m * inner + c,
                };
                let s = src[first + m * mid_stride] as usize;
                out_block[m * inner + c] = lut[(wire % sets) * 256 + s];
            }
        }
        for k in (0..rank - 2).rev() {
            idx[k] += 1;
            if idx[k] < t.dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// One axis of a uint8 bilinear resize: for each output index, the first input index and the
/// fixed-point weights of its taps.
#[derive(Clone, Debug)]
struct ResizeAxis {
    /// `(first input index, offset into weights, taps)` per output index.
    taps: Vec<(usize, usize, usize)>,
    weights: Vec<i32>,
    precision: u32,
}

impl ResizeAxis {
    /// Bilinear (a triangle filter of support 1, no antialiasing) from `n_in` to `n_out`
    /// samples with half-pixel centres; weights normalised, then rounded to 16-bit fixed point
    /// with as many fraction bits as the largest weight allows.
    fn new(n_in: usize, n_out: usize) -> ResizeAxis {
        let scale = n_in as f64 / n_out as f64;
        let mut taps = Vec::with_capacity(n_out);
        let mut real = Vec::new();
        for i in 0..n_out {
            let center = scale * (i as f64 + 0.5);
            let first = ((center - 1.0 + 0.5) as i64).max(0) as usize;
            let last = ((center + 1.0 + 0.5) as i64)
                .min(n_in as i64)
                .max(first as i64) as usize;
            let offset = real.len();
            for j in first..last {
                let x = j as f64 - center + 0.5;
                real.push((1.0 - x.abs()).max(0.0));
            }
            let total: f64 = real[offset..].iter().sum();
            if total != 0.0 {
                real[offset..].iter_mut().for_each(|w| *w /= total);
            }
            taps.push((first, offset, last - first));
        }
        let max = real.iter().copied().fold(0.0f64, f64::max);
        let mut precision = 0;
        while precision < 22
            && (0.5 + max * f64::from(1u32 << (precision + 1))) < f64::from(1u32 << 15)
        {
            precision += 1;
        }
        let one = f64::from(1u32 << precision);
        let weights = real
            .iter()
            .map(|&w| if w < 0.0 { (-0.5 + w * one).trunc() } else { (0.5 + w * one).trunc() } as i32)
            .collect();
        ResizeAxis {
            taps,
            weights,
            precision,
        }
    }

    /// Output sample `i` from the inputs `at(first..first + taps)`, rounded and clamped.
    fn sample(&self, i: usize, at: impl Fn(usize) -> u8) -> u8 {
        let (first, offset, n) = self.taps[i];
        let mut acc: i32 = 1 << self.precision.saturating_sub(1);
        for (j, &k) in self.weights[offset..offset + n].iter().enumerate() {
            acc += i32::from(at(first + j)) * k;
        }
        (acc >> self.precision).clamp(0, 255) as u8
    }
}

/// Resizes interleaved `uint8` images of one size to another, as LeRobot 0.6.1's async server
/// resizes camera frames (`F.interpolate(mode="bilinear", align_corners=False)` on a uint8
/// HWC frame): torch's uint8 kernel, separable (horizontal, then vertical, each rounded to
/// uint8) with fixed-point weights, reproduced so that the pixels are the same. Weights and
/// the intermediate buffer are made once, for one pair of sizes.
#[derive(Clone, Debug)]
pub struct Resize {
    from: (usize, usize),
    to: (usize, usize),
    channels: usize,
    horizontal: Option<ResizeAxis>,
    vertical: Option<ResizeAxis>,
    tmp: Vec<u8>,
}

impl Resize {
    /// From `(height, width)` to `(height, width)`, `channels` interleaved. `from` may come
    /// from a client (the camera size it declares): every size is checked arithmetic and the
    /// buffer a fallible allocation, so a lying size is an error, never an abort.
    pub fn new(
        from: (usize, usize),
        to: (usize, usize),
        channels: usize,
    ) -> Result<Resize, String> {
        let bytes = |(h, w): (usize, usize)| {
            h.checked_mul(w)
                .and_then(|n| n.checked_mul(channels))
                .ok_or_else(|| format!("a {h}x{w}x{channels} frame's size overflows"))
        };
        if from.0 == 0 || from.1 == 0 || to.0 == 0 || to.1 == 0 || channels == 0 {
            return Err(format!(
                "cannot resize {}x{} to {}x{} ({channels} channels): no size may be 0",
                from.1, from.0, to.1, to.0
            ));
        }
        bytes(from)?;
        bytes(to)?;
        let horizontal = (from.1 != to.1).then(|| ResizeAxis::new(from.1, to.1));
        let vertical = (from.0 != to.0).then(|| ResizeAxis::new(from.0, to.0));
        let mut tmp = Vec::new();
        if horizontal.is_some() && vertical.is_some() {
            let n = bytes((from.0, to.1))?;
            tmp.try_reserve_exact(n).map_err(|_| {
                format!(
                    "cannot allocate {n} bytes to resize a {}x{} frame",
                    from.1, from.0
                )
            })?;
            tmp.resize(n, 0);
        }
        Ok(Resize {
            from,
            to,
            channels,
            horizontal,
            vertical,
            tmp,
        })
    }

    /// The input size it takes.
    pub fn from(&self) -> (usize, usize) {
        self.from
    }

    /// Resizes `src` into `dst`; false if either length does not match its size.
    pub fn run(&mut self, src: &[u8], dst: &mut [u8]) -> bool {
        let c = self.channels;
        let ((sh, sw), (dh, dw)) = (self.from, self.to);
        // Sizes were checked in `new`: these products fit a usize.
        if src.len() != sh * sw * c || dst.len() != dh * dw * c {
            return false;
        }
        let horizontal = |ax: &ResizeAxis, src: &[u8], out: &mut [u8]| {
            for y in 0..sh {
                for x in 0..dw {
                    for ch in 0..c {
                        out[(y * dw + x) * c + ch] = ax.sample(x, |j| src[(y * sw + j) * c + ch]);
                    }
                }
            }
        };
        let vertical = |ax: &ResizeAxis, src: &[u8], out: &mut [u8]| {
            for y in 0..dh {
                for x in 0..dw {
                    for ch in 0..c {
                        out[(y * dw + x) * c + ch] = ax.sample(y, |j| src[(j * dw + x) * c + ch]);
                    }
                }
            }
        };
        match (&self.horizontal, &self.vertical) {
            (Some(h), Some(v)) => {
                horizontal(h, src, &mut self.tmp);
                vertical(v, &self.tmp, dst);
            }
            (Some(h), None) => horizontal(h, src, dst),
            (None, Some(v)) => vertical(v, src, dst),
            (None, None) => dst.copy_from_slice(src),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn u8_to_f32_with_scale() {
        let src: Vec<u8> = vec![0, 51, 255];
        let t = Transform::elementwise(
            ElemType::U8,
            ElemType::F32,
            3,
            Affine::normalize(1.0 / 255.0, 0.0, &[], &[], 1e-6),
        );
        let mut dst = vec![0u8; 12];
        assert!(t.apply(&src, ByteOrder::Little, &mut dst));
        assert_eq!(f32s(&dst), vec![0.0, 0.2, 1.0]);
    }

    #[test]
    fn hwc_to_chw() {
        // 2x2 image, 3 channels; pixel (h, w) channel c = 100*c + 10*h + w.
        let (h, w, c) = (2, 2, 3);
        let mut src = vec![0u8; h * w * c];
        for y in 0..h {
            for x in 0..w {
                for ch in 0..c {
                    src[(y * w + x) * c + ch] = (100 * ch + 10 * y + x) as u8;
                }
            }
        }
        let t = Transform::permuted(
            ElemType::U8,
            ElemType::U8,
            &[h, w, c],
            &[2, 0, 1],
            Affine::IDENTITY,
        );
        let mut dst = vec![0u8; src.len()];
        assert!(t.apply(&src, ByteOrder::Little, &mut dst));
        assert_eq!(
            dst,
            vec![0, 1, 10, 11, 100, 101, 110, 111, 200, 201, 210, 211]
        );
    }

    #[test]
    fn per_feature_normalisation_and_byte_swap() {
        // big-endian f64 state [2.0, 4.0]; mean [1, 2], std [1, 2] -> [1, 1]
        let mut src = Vec::new();
        for v in [2.0f64, 4.0] {
            src.extend_from_slice(&v.to_be_bytes());
        }
        let t = Transform::elementwise(
            ElemType::F64,
            ElemType::F32,
            2,
            Affine::normalize(1.0, 0.0, &[1.0, 2.0], &[1.0, 2.0], 1e-6),
        );
        let mut dst = vec![0u8; 8];
        assert!(t.apply(&src, ByteOrder::Big, &mut dst));
        let out = f32s(&dst);
        assert!(
            (out[0] - 1.0).abs() < 1e-5 && (out[1] - 1.0).abs() < 1e-5,
            "{out:?}"
        );
    }

    #[test]
    fn first_columns_with_unnormalize() {
        // [2, 3] -> first 2 columns, unnormalised with mean [10, 20], std [1, 1].
        let src: Vec<u8> = [0f32, 1., 2., 3., 4., 5.]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = Transform::first_columns(
            ElemType::F32,
            ElemType::F64,
            &[2, 3],
            2,
            Affine::unnormalize(&[10.0, 20.0], &[1.0, 1.0], 1e-6),
        );
        let mut dst = vec![0u8; t.dst_bytes()];
        assert!(t.apply(&src, ByteOrder::Little, &mut dst));
        let out: Vec<f64> = dst
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want = [10.0, 21.0, 13.0, 24.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-5, "{out:?}");
        }
    }

    #[test]
    fn length_mismatch_is_refused_not_panicking() {
        let t = Transform::elementwise(ElemType::F32, ElemType::F32, 4, Affine::IDENTITY);
        let mut dst = vec![0u8; 16];
        assert!(!t.apply(&[0u8; 15], ByteOrder::Little, &mut dst));
    }

    #[test]
    fn saturating_casts() {
        let src: Vec<u8> = [-5.0f32, 300.0, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = Transform::elementwise(ElemType::F32, ElemType::U8, 3, Affine::IDENTITY);
        let mut dst = vec![9u8; 3];
        assert!(t.apply(&src, ByteOrder::Little, &mut dst));
        assert_eq!(dst, vec![0, 255, 0]);
    }

    #[test]
    fn lookup_table_path_matches_the_direct_path_bit_for_bit() {
        let shape = [32usize, 24, 3];
        let n: usize = shape.iter().product();
        let src: Vec<u8> = (0..4096).map(|i| (i * 37 % 256) as u8).collect();
        let per_channel =
            Affine::normalize(2.0 / 255.0, -1.0, &[0.1, -0.2, 0.3], &[0.5, 1.5, 2.0], 1e-6);
        let cases = [
            Transform::permuted(
                ElemType::U8,
                ElemType::F32,
                &shape,
                &[2, 0, 1],
                per_channel.clone(),
            ),
            Transform::permuted(
                ElemType::U8,
                ElemType::F16,
                &shape,
                &[2, 0, 1],
                Affine::Scalar { a: 0.5, b: 3.0 },
            ),
            Transform::permuted(
                ElemType::I8,
                ElemType::F64,
                &shape,
                &[1, 0, 2],
                per_channel.clone(),
            ),
            Transform::elementwise(ElemType::U8, ElemType::F32, n, per_channel.clone()),
            // A feature map on one channel.
            Transform::elementwise(
                ElemType::U8,
                ElemType::F32,
                n,
                Affine::per_feature(
                    3,
                    &[1.0 / 255.0],
                    &[0.0],
                    &[0.1, -0.2, 0.3],
                    &[0.5, 1.5, 2.0],
                    1e-6,
                    Some((FeatureMap::AlohaGripperToAngular, &[1])),
                ),
            ),
            // CHW→HWC: a 3-wide innermost axis (the short-row path), without and with
            // conversion, and with coefficients per element of the wire's last axis.
            Transform::permuted(
                ElemType::U8,
                ElemType::U8,
                &[3, 32, 24],
                &[1, 2, 0],
                Affine::IDENTITY,
            ),
            Transform::permuted(
                ElemType::U8,
                ElemType::F32,
                &[3, 32, 24],
                &[1, 2, 0],
                Affine::Scalar {
                    a: 2.0 / 255.0,
                    b: -1.0,
                },
            ),
            Transform::permuted(
                ElemType::U8,
                ElemType::F32,
                &[3, 96, 12],
                &[1, 2, 0],
                Affine::normalize(
                    1.0,
                    0.0,
                    &[0.5; 12],
                    &[1.0, 2.0, 3.0, 4.0, 0.5, 0.25, 1.0, 2.0, 3.0, 4.0, 0.5, 0.25],
                    1e-6,
                ),
            ),
            Transform::first_columns(
                ElemType::U8,
                ElemType::F32,
                &[n / 4, 4],
                3,
                Affine::unnormalize(&[1.0, 2.0, 3.0], &[0.5, 0.25, 2.0], 1e-6),
            ),
        ];
        for t in cases {
            assert!(!t.lut.is_empty(), "{t:?}");
            let src = &src[..t.src_len * t.src_type.size()];
            let mut fast = vec![0u8; t.dst_bytes()];
            assert!(t.apply(src, ByteOrder::Little, &mut fast));
            let mut direct = t.clone();
            direct.lut.clear();
            let mut slow = vec![0u8; t.dst_bytes()];
            assert!(direct.apply(src, ByteOrder::Little, &mut slow));
            assert_eq!(fast, slow, "{:?} -> {:?}", t.src_type, t.dst_type);
        }
    }
}
