//! Draws the dashboard's time-series panels from a real run's query_range data, for
//! docs/metrics.md (Grafana cannot run here; its queries can). The data comes from the
//! agent's end-to-end test:
//!
//! ```text
//! SKEWLESS_PANEL_DATA=/tmp/panels cargo test -p skewless --test metrics -- --ignored a_real
//! cargo run -p skewless-admin --example panel_charts -- /tmp/panels docs/panels
//! ```
//!
//! One SVG per JSON file (`{title, unit, service, series: [{name, points: [[t, v]]}]}`).

use plotters::prelude::*;
use serde_json::Value;

const COLOURS: &[RGBColor] = &[
    RGBColor(0x4c, 0x78, 0xa8),
    RGBColor(0xf5, 0x85, 0x18),
    RGBColor(0x54, 0xa2, 0x4b),
    RGBColor(0xe4, 0x57, 0x56),
    RGBColor(0x72, 0xb7, 0xb2),
    RGBColor(0xb2, 0x79, 0xa2),
    RGBColor(0x9d, 0x75, 0x5d),
    RGBColor(0xee, 0xca, 0x3b),
];

/// The y values as the panel's unit shows them, and the axis label.
fn scale(unit: &str) -> (f64, &'static str) {
    match unit {
        "percentunit" => (100.0, "%"),
        "s" => (1000.0, "ms"),
        "reqps" => (1.0, "requests/s"),
        _ => (1.0, ""),
    }
}

fn draw(doc: &Value, out: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let title = format!(
        "{} — {}",
        doc["title"].as_str().unwrap_or_default(),
        doc["service"].as_str().unwrap_or_default()
    );
    let (factor, unit) = scale(doc["unit"].as_str().unwrap_or_default());
    let series: Vec<(String, Vec<(f64, f64)>)> = doc["series"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let points = s["points"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()? * factor)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            (s["name"].as_str().unwrap_or_default().to_owned(), points)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    let t_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(t, _)| *t))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, v)| *v))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 340)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18.6))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("seconds into the run")
            .y_desc(unit)
            .label_style(("sans-serif", 14.9))
            .draw()?;
        for (i, (name, points)) in series.iter().enumerate() {
            // The fair-share line is a reference, not a backend: grey.
            let colour = if name.starts_with("fair share") {
                RGBColor(0x88, 0x88, 0x88)
            } else {
                COLOURS[i % COLOURS.len()]
            };
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    colour.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 13.0))
            .draw()?;
        root.present()?;
    }
    std::fs::write(out, svg)?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (input, output) = match args.as_slice() {
        [_, i, o] => (std::path::PathBuf::from(i), std::path::PathBuf::from(o)),
        _ => {
            eprintln!("usage: panel_charts DATA_DIR OUT_DIR");
            std::process::exit(2);
        }
    };
    std::fs::create_dir_all(&output).expect("output directory");
    let mut files: Vec<_> = std::fs::read_dir(&input)
        .expect("data directory")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for path in files {
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("JSON");
        let out = output.join(path.with_extension("svg").file_name().expect("name"));
        match draw(&doc, &out) {
            Ok(()) => println!("wrote {}", out.display()),
            Err(e) => eprintln!("{}: {e}", path.display()),
        }
    }
}
