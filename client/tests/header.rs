//! The checked-in C header is exactly what the pinned cbindgen makes of src/ffi.

mod common;

#[test]
fn the_checked_in_header_is_up_to_date() {
    let crate_dir = common::crate_dir();
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new().with_crate(crate_dir).with_config(config).generate().unwrap();
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include/netagg.h");
    if std::env::var_os("NETAGG_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is stale: regenerate it with `NETAGG_BLESS=1 cargo test -p netagg --test header`",
        path.display()
    );
}
