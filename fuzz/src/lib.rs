//! Pieces the fuzz targets share.

use arbitrary::{Arbitrary, Result, Unstructured};

/// Datagram bytes behind a one-byte length, taken in place (`Vec`'s `Arbitrary` reads its
/// length from the input's end), so a datagram is one run of input bytes.
#[derive(Debug)]
pub struct Raw(pub Vec<u8>);

impl<'a> Arbitrary<'a> for Raw {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let len = u8::arbitrary(u)? as usize;
        let len = len.min(u.len());
        Ok(Raw(u.bytes(len)?.to_vec()))
    }
}
