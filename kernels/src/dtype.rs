//! Element types and reduction operators, and the mapping from Rust types to them.

use std::fmt;
use std::str::FromStr;

/// The element types ringzero can move and reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 1,
    /// IEEE 754 binary64.
    F64 = 2,
    /// IEEE 754 binary16.
    F16 = 3,
    /// bfloat16 (the top half of an f32).
    BF16 = 4,
    /// Signed 32-bit integer.
    I32 = 5,
    /// Signed 64-bit integer.
    I64 = 6,
    /// Unsigned byte.
    U8 = 7,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The lower-case name used on the command line and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Decode a wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase();
        let alias = match l.as_str() {
            "float" | "float32" => "f32",
            "double" | "float64" => "f64",
            "half" | "float16" => "f16",
            "bfloat16" => "bf16",
            "int" | "int32" => "i32",
            "int64" => "i64",
            "uint8" | "byte" => "u8",
            other => other,
        };
        DType::ALL
            .into_iter()
            .find(|d| d.name() == alias)
            .ok_or_else(|| {
                format!("unknown dtype `{s}` (expected one of f32, f64, f16, bf16, i32, i64, u8)")
            })
    }
}

/// Reduction operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum.
    Sum = 1,
    /// Product.
    Prod = 2,
    /// Minimum (NaN handling is unspecified: the result may or may not be NaN).
    Min = 3,
    /// Maximum (NaN handling is unspecified).
    Max = 4,
    /// Sum divided by the number of ranks (integers: truncating division of the wrapped sum).
    Avg = 5,
}

impl ReduceOp {
    /// Every operator, in wire-code order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The lower-case name used on the command line and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Decode a wire code.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == code)
    }

    /// The operator applied pairwise while reducing (`Avg` reduces as `Sum`, then divides once).
    pub const fn pairwise(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            other => other,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase();
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == l)
            .ok_or_else(|| {
                format!("unknown reduce op `{s}` (expected one of sum, prod, min, max, avg)")
            })
    }
}

/// A Rust type that ringzero can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The dtype tag of this type.
    const DTYPE: DType;
    /// Convert from `f64` the way `as` does (round to nearest for floats, saturate for integers).
    fn from_f64(v: f64) -> Self;
    /// Convert to `f64` (exact for every value of every supported type but large `i64`s).
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $d:ident, |$v:ident| $from:expr, |$s:ident| $to:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn from_f64($v: f64) -> Self {
                $from
            }
            fn to_f64(self) -> f64 {
                let $s = self;
                $to
            }
        }
    };
}
element!(f32, F32, |v| v as f32, |s| s as f64);
element!(f64, F64, |v| v, |s| s);
element!(half::f16, F16, |v| half::f16::from_f64(v), |s| s.to_f64());
element!(half::bf16, BF16, |v| half::bf16::from_f64(v), |s| s
    .to_f64());
element!(i32, I32, |v| v as i32, |s| s as f64);
element!(i64, I64, |v| v as i64, |s| s as f64);
element!(u8, U8, |v| v as u8, |s| s as f64);
