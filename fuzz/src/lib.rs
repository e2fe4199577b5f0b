//! Pieces the fuzz targets share.

use arbitrary::{Arbitrary, Result, Unstructured};

/// Datagram bytes behind a one-byte length, taken in place (`Vec`'s `Arbitrary` reads its
/// length from the input's end), so a datagram is one run of input bytes. The length's
/// top bit says whether the bytes are sealed (their last four made their checksum, as
/// `netagg_wire::packet::seal` does): unsealed bytes almost never pass the checksum, and
/// sealed ones reach the checks behind it.
#[derive(Debug)]
pub struct Raw(pub Vec<u8>);

impl<'a> Arbitrary<'a> for Raw {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let prefix = u8::arbitrary(u)?;
        let len = usize::from(prefix & 0x7F).min(u.len());
        let mut bytes = u.bytes(len)?.to_vec();
        if prefix & 0x80 != 0 && bytes.len() >= netagg_wire::packet::CHECKSUM_LEN {
            netagg_wire::packet::seal(&mut bytes);
        }
        Ok(Raw(bytes))
    }
}
